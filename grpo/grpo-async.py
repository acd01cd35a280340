"""Asynchronous GRPO: Ray rollout workers generate while the trainer optimises.

The trainer assigns prompt batches to the workers, which generate them with the latest weights
they were sent; it takes whole batches of groups in the order assigned, drops any generated more
than ``train.max_policy_lag`` optimiser steps ago, and pushes weights every
``train.weight_update_frequency`` optimiser steps. A worker that fails is restarted (at most
``train.max_worker_restarts`` times) and its batches generated again.

    python grpo/grpo-async.py --config-name grpo_tiny     # CPU, local Ray
    python grpo/grpo-async.py ray.address=auto            # join a running cluster
    python grpo/grpo-async.py --config-name grpo_tiny train_model.num_devices=2  # 2 trainer ranks, rank 1 a Ray actor
"""

from __future__ import annotations

import sys
from pathlib import Path

# `python grpo/grpo-async.py` puts grpo/ first on sys.path, where grpo.py would shadow the grpo package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from grpo.loop.config import validate_config  # noqa: E402
from grpo.process.config_keys import check_before_imports  # noqa: E402

if __name__ == "__main__":
    check_before_imports(validate_config)  # a bad key or value: its one line in 0.5 s, before the imports below (~8 s)

from grpo.loop.run import Run, check_start, follow_run, start_run, train_loop  # noqa: E402
from grpo.process.ray_placement import RaySettings, driver_gpu, ray_followers, ray_session  # noqa: E402
from grpo.process.setup import hydra_main  # noqa: E402
from grpo.process.world import World  # noqa: E402
from grpo.rollout.ray_collectors import PoolSettings, RolloutPool  # noqa: E402
from grpo.tasks.data import PromptLedger  # noqa: E402


def generation(cfg) -> dict:
    """Where the rollouts are generated, as ``check_start`` and ``start_run`` take it: by the Ray rollout workers,
    one engine each, on GPUs of their own; in a cluster (``ray.address``) Ray places them and the trainer ranks,
    rank 0 on the GPU of its node that Ray holds for it."""
    return {"inference_engines": cfg.train.num_collectors, "dedicated_inference": True,
            "ray_gpu": driver_gpu if cfg.ray.address is not None else None}


def train(cfg) -> Run:
    # Ray before the models: in a cluster it places rank 0's GPU too (or the ranks' launcher's: ray_followers)
    with ray_session(RaySettings.from_config(cfg), check_start(cfg, **generation(cfg))):
        run = start_run(cfg, **generation(cfg))
        ledger = PromptLedger.from_checkpoint(run.resume_payload)  # on resume, the batches in flight are served first
        run.stop_flag.install()  # SIGTERM: finish the step, checkpoint, stop the workers (Ray's handler aborts)
        pool = RolloutPool(PoolSettings.from_config(cfg), run.devices.torch_devices("inference"), run.stop_ids, ledger,
                           run.trainer.engine_weights(), run.trainer.policy_version)  # on resume: its weights
        return train_loop(run, pool)


if __name__ == "__main__":
    if World.launched_main():  # alone, or rank 0: it runs the rollout workers, evaluates and writes; its other
        # trainer ranks are Ray actors, placed by Ray beside the rollout workers, on a cluster's nodes too
        hydra_main(train, __file__, check=lambda cfg: check_start(cfg, **generation(cfg)),
                   followers=lambda cfg, devices, script, size: ray_followers(
                       RaySettings.from_config(cfg), devices, script, size, follow_run=follow_run))
    else:  # torchrun's other ranks train on the rollouts rank 0 sends (grpo/process/world.py)
        sys.exit(follow_run())
