"""Synchronous GRPO: collect a batch of grouped replies, optimise on it, push the weights, repeat.

    python grpo/grpo.py                               # GSM8K, Qwen2.5, vLLM (GPU)
    python grpo/grpo.py --config-name grpo_tiny       # embedded tiny model, CPU, minutes
    python grpo/grpo.py --config-name grpo_tiny --multirun optimizer.lr=1e-4,3e-4
    python grpo/grpo.py --config-name grpo_tiny train_model.num_devices=2  # 2 data-parallel trainer ranks (gloo on CPU)
    torchrun --nproc_per_node=2 grpo/grpo.py --config-name grpo_tiny       # the same 2 ranks, torchrun's
    python grpo/grpo.py --config-name grpo_tiny train_model.num_devices=2 inference_model.num_devices=2  # both generate
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python grpo/grpo.py` puts grpo/ first on sys.path, where this file would shadow the grpo package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from grpo.loop.config import validate_config  # noqa: E402
from grpo.process.config_keys import check_before_imports  # noqa: E402

if __name__ == "__main__":
    check_before_imports(validate_config)  # a bad key or value: its one line in 0.5 s, before the imports below (~8 s)

from grpo.loop.run import Run, check_start, follow_run, start_run, train_loop  # noqa: E402
from grpo.process.devices import PlacementSettings, trainer_ranks  # noqa: E402
from grpo.process.setup import hydra_main  # noqa: E402
from grpo.process.world import World  # noqa: E402
from grpo.rollout.local_rollouts import rank_rollouts  # noqa: E402
from grpo.tasks.data import PromptLedger  # noqa: E402


def generation(cfg) -> dict:
    """Where the rollouts are generated, as ``check_start`` and ``start_run`` take it: on the trainer ranks' own
    engines, one on each at most (one per inference GPU)."""
    return {"inference_engines": trainer_ranks(PlacementSettings.from_config(cfg)) or 1, "dedicated_inference": False}


def train(cfg) -> Run:
    run = start_run(cfg, **generation(cfg))  # checks, devices, models, GRPO step, logger
    ledger = PromptLedger.from_checkpoint(run.resume_payload)  # the prompt batches trained before a resume
    # rank 0 generates alone, or every rank its share of each prompt batch on its own engine
    world = run.trainer.world if run.devices.generating_ranks > 1 else World()
    return train_loop(run, rank_rollouts(run.rollout, run.task, run.tokenizer, run.engine, ledger, world))


if __name__ == "__main__":
    if World.launched_main():  # alone, or rank 0: it generates, evaluates and writes the run
        hydra_main(train, __file__, check=lambda cfg: check_start(cfg, **generation(cfg)))
    else:  # the other ranks (rank 0's or torchrun's) train on the rollouts rank 0 sends, generating their share of
        # them where each has an engine (grpo/process/world.py)
        sys.exit(follow_run())
