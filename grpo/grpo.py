"""Synchronous GRPO: collect a batch of grouped replies, optimise on it, push the weights, repeat.

    python grpo/grpo.py                               # GSM8K, Qwen2.5, vLLM (GPU)
    python grpo/grpo.py --config-name grpo_tiny       # embedded tiny model, CPU, minutes
    python grpo/grpo.py --config-name grpo_tiny --multirun optimizer.lr=1e-4,3e-4
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python grpo/grpo.py` puts grpo/ first on sys.path, where this file would shadow the grpo package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import time  # noqa: E402

from grpo.data import PromptLedger, serve_from  # noqa: E402
from grpo.dynamic_sampling import draw_step_batch  # noqa: E402
from grpo.envs import make_collector, make_env  # noqa: E402
from grpo.run import TrainingRun  # noqa: E402
from grpo.setup import hydra_main  # noqa: E402
from grpo.user_rewards import take_reward_seconds  # noqa: E402


def train(cfg) -> TrainingRun:
    run = TrainingRun(cfg, inference_engines=1, dedicated_inference=False)  # checks, devices, models, GRPO step, logger
    env = make_env(cfg, run.tokenizer, split=cfg.env.train_split, repeats=cfg.env.repeats, num_envs=cfg.env.num_envs)
    collector = make_collector(env, run.inference.policy, cfg.train.dialog_turns_per_batch)
    ledger = PromptLedger.from_checkpoint(run.resume_payload)  # the prompt batches trained before a resume
    serve_from(env, collector, ledger.sequential_start())  # the collector then draws batch after batch
    run.checkpoint_extras = lambda: {"prompt_stream": ledger.state()}
    batches_per_step = cfg.train.dialog_turns_per_batch // cfg.env.num_envs
    batches, taken = iter(collector), []  # taken: the prompt batches this step's collections drew

    def collect():  # one collection: G replies for each prompt, with sampler log-probs
        taken.extend(ledger.take() for _ in range(batches_per_step))  # the batches the collector draws next
        return next(batches).reshape(-1)

    with run.guard():
        run.evaluate_if_due(force=True)
        for step in run.steps():
            t0 = time.perf_counter()
            # one collection; with dynamic sampling, more until every group trained has distinct rewards
            rollouts, filtering = draw_step_batch(collect, cfg.train.dialog_turns_per_batch,
                                                  dynamic=cfg.train.dynamic_sampling,
                                                  max_extra_batches=cfg.train.max_extra_generation_batches)
            t_gen = time.perf_counter() - t0
            metrics = run.train_on(rollouts)        # dense batch, reference and KL, advantages, clipped loss, optimiser
            ledger.consume(taken)
            taken.clear()
            metrics["weight_sync_s"] = run.inference.push_weights(run.policy_model, run.policy_version)
            timings = {"generation_s": t_gen, "reward_s": take_reward_seconds(env)}  # reward_s: part of generation_s
            run.log_step(step, metrics | filtering | timings, t0)
            run.evaluate_if_due()
            run.checkpoint_if_due()
    collector.shutdown()
    return run


if __name__ == "__main__":
    hydra_main(train)
