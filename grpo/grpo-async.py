"""Asynchronous GRPO: Ray rollout workers generate while the trainer optimises.

Workers keep generating with the latest weights they were sent; the trainer takes whole
batches of groups from a bounded FIFO, drops any generated more than ``train.max_policy_lag``
optimiser steps ago, and pushes weights every ``train.weight_update_frequency`` optimiser steps.

    python grpo/grpo-async.py --config-name grpo_tiny     # CPU, local Ray
    python grpo/grpo-async.py ray.address=auto            # join a running cluster
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python grpo/grpo-async.py` puts grpo/ first on sys.path, where grpo.py would shadow the grpo package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import time  # noqa: E402

import hydra  # noqa: E402
import ray  # noqa: E402
from tensordict import set_list_to_stack  # noqa: E402

from grpo.inference import inference_state_dict  # noqa: E402
from grpo.ray_collectors import RolloutPool  # noqa: E402
from grpo.run import TrainingRun  # noqa: E402
from grpo.setup import clear_errors, ray_pythonpath  # noqa: E402


def train(cfg) -> TrainingRun:
    run = TrainingRun(cfg, mode="async")  # config checks, devices, models, envs, loss, optimiser, logger
    ray.init(address=cfg.ray.address, num_cpus=cfg.ray.num_cpus, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": ray_pythonpath()}}, ignore_reinit_error=True)
    pool = RolloutPool(cfg, run.rollout_devices)
    pool.push_weights(inference_state_dict(run.policy_model), version=run.optim_steps)  # restored weights on resume
    pushed_at = run.optim_steps
    try:
        with run.guard():
            run.evaluate_if_due(force=True)
            for step in run.steps():
                t0 = time.perf_counter()
                batches = [pool.next_batch(run.optim_steps) for _ in range(run.batches_per_step)]
                batch = batches[0][0] if len(batches) == 1 else _cat([b for b, _ in batches])
                lags = [lag for _, lag in batches]
                samples, metrics = run.prepare(batch)   # dense batch: reference log-probs, KL, group advantages
                metrics |= run.optimize(samples)        # epochs x shuffled minibatches of the clipped GRPO loss
                if run.optim_steps - pushed_at >= cfg.train.weight_update_frequency:
                    metrics["weight_sync_s"] = pool.push_weights(inference_state_dict(run.policy_model),
                                                                 version=run.optim_steps)
                    pushed_at = run.optim_steps
                metrics |= {"policy_lag_mean": sum(lags) / len(lags), "policy_lag_max": max(lags),
                            "policy_version": run.optim_steps} | run.rate_metrics(pool.stats())
                run.log_step(step, metrics, t0)
                run.evaluate_if_due()
                run.checkpoint_if_due()
    finally:
        pool.shutdown()
        ray.shutdown()
    return run


def _cat(batches):
    from tensordict import lazy_stack

    return lazy_stack([s for b in batches for s in b.unbind(0)])


@hydra.main(version_base="1.3", config_path="../config", config_name="grpo_gsm8k")
def main(cfg) -> None:
    set_list_to_stack(True).set()
    with clear_errors():
        train(cfg)


if __name__ == "__main__":
    main()
