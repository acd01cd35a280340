"""Synchronous GRPO: collect a batch of grouped replies, optimise on it, push the weights, repeat.

    python grpo/grpo.py                               # GSM8K, Qwen2.5, vLLM (GPU)
    python grpo/grpo.py --config-name grpo_tiny       # embedded tiny model, CPU, minutes
    python grpo/grpo.py --config-name grpo_tiny --multirun optimizer.lr=1e-4,3e-4
    python grpo/grpo.py --config-name grpo_tiny train_model.num_devices=2  # 2 data-parallel trainer ranks (gloo on CPU)
    torchrun --nproc_per_node=2 grpo/grpo.py --config-name grpo_tiny       # the same 2 ranks, torchrun's
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python grpo/grpo.py` puts grpo/ first on sys.path, where this file would shadow the grpo package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from grpo.loop.run import Run, follow_run, start_run, train_loop  # noqa: E402
from grpo.process.setup import hydra_main  # noqa: E402
from grpo.process.world import World  # noqa: E402
from grpo.rollout.local_rollouts import CollectorRollouts  # noqa: E402
from grpo.tasks.data import PromptLedger  # noqa: E402
from grpo.tasks.envs import make_collector, make_env  # noqa: E402


def train(cfg) -> Run:
    run = start_run(cfg, inference_engines=1, dedicated_inference=False)  # checks, devices, models, GRPO step, logger
    env = make_env(cfg, run.tokenizer, split=cfg.env.train_split, repeats=cfg.env.repeats, num_envs=cfg.env.num_envs)
    collector = make_collector(env, run.engine.policy, cfg.train.dialog_turns_per_batch)
    ledger = PromptLedger.from_checkpoint(run.resume_payload)  # the prompt batches trained before a resume
    return train_loop(run, CollectorRollouts(cfg, env, collector, ledger, run.engine))


if __name__ == "__main__":
    if World.launched_main():  # alone, or rank 0: it generates, evaluates and writes the run
        hydra_main(train, __file__)
    else:  # the other ranks (rank 0's or torchrun's) train on the rollouts rank 0 sends (grpo/process/world.py)
        sys.exit(follow_run())
