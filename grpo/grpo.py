"""Synchronous GRPO: collect a batch of grouped replies, then optimise on it, then push weights.

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

import hydra  # noqa: E402
from tensordict import set_list_to_stack  # noqa: E402

from grpo.envs import make_collector  # noqa: E402
from grpo.run import TrainingRun  # noqa: E402
from grpo.setup import clear_errors  # noqa: E402


def train(cfg) -> TrainingRun:
    run = TrainingRun(cfg, mode="sync")  # config checks, devices, models, envs, loss, optimiser, logger
    collector = make_collector(run.env, run.inference.policy, cfg.train.dialog_turns_per_batch)
    run.attach_collector(collector)                 # its pending prompts are checkpointed too
    with run.guard():
        run.evaluate_if_due(force=True)
        batches = iter(collector)
        for step in run.steps():
            t0 = time.perf_counter()
            batch = next(batches).reshape(-1)       # G replies for each prompt, with sampler log-probs
            t_gen = time.perf_counter() - t0
            samples, metrics = run.prepare(batch)   # dense batch: reference log-probs, KL, group advantages
            metrics |= run.optimize(samples)        # epochs x shuffled minibatches of the clipped GRPO loss
            metrics["weight_sync_s"] = run.inference.push_weights(run.policy_model)  # before the next collection
            metrics |= {"generation_s": t_gen, "policy_version": run.inference.version}
            run.log_step(step, metrics, t0)
            run.evaluate_if_due()
            run.checkpoint_if_due()
    collector.shutdown()
    return run


@hydra.main(version_base="1.3", config_path="../config", config_name="grpo_gsm8k")
def main(cfg) -> None:
    set_list_to_stack(True).set()
    with clear_errors():
        train(cfg)


if __name__ == "__main__":
    main()
