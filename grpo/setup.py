"""Start-of-run plumbing shared by both scripts: paths, seeds and signals."""

from __future__ import annotations

import os
import random
import signal
import sys
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import OmegaConf
from tensordict import set_list_to_stack

from grpo.errors import clear_errors

REPO_ROOT = Path(__file__).resolve().parents[1]


def hydra_main(train) -> None:
    """Run a script's ``train(cfg)`` on the Hydra config named on the command line (grpo_gsm8k by default)."""

    @hydra.main(version_base="1.3", config_path=str(REPO_ROOT / "config"), config_name="grpo_gsm8k")
    def main(cfg) -> None:
        set_list_to_stack(True).set()
        with clear_errors():
            train(cfg)

    main()


def ray_pythonpath() -> str:
    """PYTHONPATH for Ray workers: the repo (for ``grpo``) and whatever this process was given."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


def resolve_local_paths(cfg) -> None:
    """Relative ``model.name`` / ``env.dataset`` that do not exist from the working directory are
    taken from the repo root, so the tiny configs run from anywhere."""
    for section, key in (("model", "name"), ("env", "dataset")):
        value = cfg[section][key]
        if isinstance(value, str) and not Path(value).is_absolute() and not Path(value).exists():
            candidate = REPO_ROOT / value
            if candidate.exists():
                cfg[section][key] = str(candidate)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolved_config(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


class StopRequested(Exception):
    """SIGTERM/SIGHUP/SIGINT arrived; raised at the next step boundary so the checkpoint is consistent."""

    def __init__(self, signum: int):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.exit_code = 128 + signum


class StopFlag:
    """Records SIGTERM (preemption), SIGHUP (the terminal or ssh session closed) and a first Ctrl-C; a second
    Ctrl-C interrupts at once."""

    def __init__(self):
        self.signum: int | None = None
        self.install()

    def install(self) -> None:
        """(Re)claim SIGTERM, SIGHUP and SIGINT: ``ray.init`` replaces the SIGTERM handler with one that aborts."""
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then checkpointing and exiting "
              "(Ctrl-C again to stop now, without a checkpoint)", file=sys.stderr, flush=True)

    def raise_if_set(self) -> None:
        if self.signum is not None:
            raise StopRequested(self.signum)
