"""Start-of-run plumbing shared by both scripts: paths, the run dir, seeds and signals."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import gc
import os
import random
import signal
import socket
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from tensordict import set_list_to_stack

from grpo.process.config_keys import CONFIG_DIR, REPO_ROOT
from grpo.process.console import quiet_libraries
from grpo.process.devices import PlacementSettings
from grpo.process.errors import ConfigError, RunDirError, clear_errors
from grpo.process.launch import agree_with_launcher, trainer_world


def hydra_main(train, script: str, check: Callable, followers=None) -> None:
    """Run a script's ``train(cfg)`` on the Hydra config named on the command line (grpo_gsm8k by default) as
    rank 0 of the trainer's ranks: ``train_model.num_devices=N`` starts the other N-1 (``followers(cfg, devices,
    script, size)``: by default ``script`` run as each) once ``check(cfg)`` passed, torchrun's are joined
    (``grpo.process.launch``), and they stop with it however it ends."""

    @hydra.main(version_base="1.3", config_path=str(CONFIG_DIR), config_name="grpo_gsm8k")
    def main(cfg) -> None:
        set_list_to_stack(True).set()
        quiet_libraries()
        placement = PlacementSettings.from_config(cfg)
        with clear_errors(), trainer_world(placement, script, lambda: check(cfg),
                                           followers and functools.partial(followers, cfg)) as world:
            if (launcher_count := agree_with_launcher(placement, world)) is not None:
                cfg.train_model.num_devices = launcher_count
            try:
                train(cfg)
            except Exception:
                raise_if_interrupted_twice()
                raise

    main()


def ray_pythonpath() -> str:
    """PYTHONPATH for Ray workers: the repo (for ``grpo``) and whatever this process was given."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


class RunDirClaim:
    """This process's hold on a run dir for the run's life: an exclusive lock on its ``.run.lock``.

    Two runs started in one second shared a run dir once: both passed the "already holds a run"
    check before either wrote its metrics. A lock cannot race, and the OS drops it when the process
    ends, however it ends, so a crashed run leaves no stale claim behind.
    """

    def __init__(self, run_dir: Path):
        with unwritable_run_dir(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(run_dir / ".run.lock", "a+")  # held open: the lock lasts as long as the file
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            self._file.close()
            raise ConfigError(f"{run_dir} is in use by another run ({holder}); let that run finish or stop it, or give "
                              "this one another hydra.run.dir (by default each run gets a new one).") from None
        with unwritable_run_dir(run_dir):
            self._file.truncate(0)
            self._file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")  # who holds it, for a refused run
            self._file.flush()

    def release(self) -> None:
        self._file.close()  # closing the file drops the lock


def write_hydra_record(run_dir: Path, task_config: str) -> None:
    """The ``.hydra/`` folder Hydra writes into a run dir (the composed config, Hydra's own, the command
    line's overrides), written by the run once it holds its run dir. Hydra would write it before the
    run starts, and so over the files of a run already holding that dir, whose recorded overrides are
    what ``resume=auto`` finds it by: our configs set ``hydra.output_subdir: null``."""
    hydra_cfg = HydraConfig.instance().cfg
    folder = run_dir / ".hydra"
    with unwritable_run_dir(run_dir):
        folder.mkdir(exist_ok=True)
        for name, text in (("config.yaml", task_config), ("hydra.yaml", OmegaConf.to_yaml(hydra_cfg)),
                           ("overrides.yaml", OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))):
            (folder / name).write_text(text)


@contextlib.contextmanager
def unwritable_run_dir(run_dir: Path):
    """A run dir that cannot take a run's first files (16 KiB free: ENOSPC from the middle of the start) is
    refused in one line, as one without room for a checkpoint is."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS):
            raise
        raise RunDirError(f"hydra.run.dir={run_dir} cannot be written ({err.strerror}); free space on its disk (or "
                          "make it writable), or point hydra.run.dir at another disk, then run again.") from err


_long_lived_frozen = False  # by freeze_long_lived_objects, in this process


def freeze_long_lived_objects() -> None:
    """Take every object alive now (models, tokenizer, data, compiled graphs) out of the garbage collector's scans,
    after a collection so that no garbage is kept. Its full collections walk every object: in a rollout process one
    cost 0.28 s of every third 128-reply collection (one CPU thread, the tiny model), 0.03 s once frozen. Once per
    process: called after every step or batch, the first (which built what the run keeps) freezes, the rest return.

    Once by its own flag, not while ``gc.get_freeze_count()`` is 0: Python 3.12 starts with 375 objects of its own
    frozen, so nothing more was frozen there, and full collections took 0.56-0.65 s inside steps. 1.5B-shape default
    job on an H100 (Python 3.12), steps 2-7: 5.52 s a step frozen, 5.69 s not."""
    global _long_lived_frozen
    if not _long_lived_frozen:
        _long_lived_frozen = True
        gc.collect()
        gc.freeze()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolved_config(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)


class StopRequested(Exception):
    """SIGTERM/SIGHUP/SIGINT arrived; raised at the next step boundary so the checkpoint is consistent, or
    ``within_step`` by a wait that must not outlast it (``raise_if_stop_signalled``)."""

    def __init__(self, signum: int, within_step: bool = False):
        super().__init__(f"received {signal.Signals(signum).name}")
        self.exit_code, self.within_step = 128 + signum, within_step


_signalled: int | None = None  # the stop signal the run's StopFlag took, for waits on other threads or processes
_interrupted_twice = False  # a second Ctrl-C came: the run is stopping now, without a checkpoint


_next_unraisable_hook = sys.__unraisablehook__  # the hook quiet_second_interrupt passes reports on to


def quiet_second_interrupt(unraisable) -> None:
    """A second Ctrl-C's SystemExit that lands in a callback Python cannot raise from (a weakref's: importlib's
    module-lock cleanup, once in ~800 test runs) is reported as ignored, with a traceback. The run stops all the
    same, at its step's end (``raise_if_interrupted_twice``), so that report is left out; any other goes on."""
    if not (_interrupted_twice and isinstance(unraisable.exc_value, SystemExit)):
        _next_unraisable_hook(unraisable)


def raise_if_interrupted_twice() -> None:
    """Where an error ends the run: after a second Ctrl-C, it is that Ctrl-C's doing. Its SystemExit lands wherever
    Python is, and a library's cleanup on the way out can raise an error of its own in its place (a tensordict's
    ``with td.view(...)`` exit, seen once in 700 test runs: a 40-line traceback, exit 1, instead of 130)."""
    if _interrupted_twice:
        raise SystemExit(128 + signal.SIGINT) from None


def raise_if_stop_signalled(waiting_on: str) -> None:
    """For a wait with no end in sight (a reward function that may hang, rollout workers): a stop signal ends
    it at once. A hung call used to hold the run past SIGTERM's grace period (60 s and still hung), and then
    SIGKILL lost every step since the last checkpoint; the step in progress is dropped instead, and the
    last finished one checkpointed."""
    if _signalled is not None:
        print(f"stopping inside the step in progress (waiting on {waiting_on}): it is dropped", file=sys.stderr,
              flush=True)
        raise StopRequested(_signalled, within_step=True)


def detach_from_terminal() -> None:
    """Send what goes to a terminal to /dev/null: after a hangup (the ssh session closed) every write to it
    fails with EIO, and the first, a progress bar's or this handler's own line, ended the run with status 1
    (measured with a pty closed under a grpo_tiny run). Output redirected to files keeps going there."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        if stat.S_ISCHR(os.fstat(fd).st_mode):  # a terminal (isatty is False once it hung up: EIO)
            os.dup2(devnull, fd)
    os.close(devnull)


class StopFlag:
    """Records SIGTERM (preemption), SIGHUP (the terminal or ssh session closed) and a first Ctrl-C; a second
    Ctrl-C stops the run at once, without a checkpoint. ``last_checkpoint``: what the run keeps then, in words."""

    def __init__(self, last_checkpoint: Callable[[], str]):
        global _signalled, _interrupted_twice
        self.signum: int | None = None
        _signalled, _interrupted_twice = None, False
        self.last_checkpoint = last_checkpoint
        self.install()

    def install(self) -> None:
        """(Re)claim SIGTERM, SIGHUP and SIGINT: ``ray.init`` replaces the SIGTERM handler with one that aborts."""
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(signum, self._handle)
        global _next_unraisable_hook
        if sys.unraisablehook is not quiet_second_interrupt:  # module-level: a flag would keep its run alive
            _next_unraisable_hook, sys.unraisablehook = sys.unraisablehook, quiet_second_interrupt

    def _handle(self, signum, frame):
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            # SystemExit, not KeyboardInterrupt: no traceback of whatever it lands in (40 lines of decode_attention),
            # and the finally blocks still run (engines and rollout workers shut down, logs closed)
            global _interrupted_twice
            _interrupted_twice = True
            print(f"\ninterrupted again: stopping now without a checkpoint; {self.last_checkpoint()}", file=sys.stderr,
                  flush=True)
            raise SystemExit(128 + signum)
        global _signalled
        if signum == signal.SIGHUP:
            detach_from_terminal()
        self.signum = _signalled = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then checkpointing and exiting "
              "(Ctrl-C again to stop now, without a checkpoint)", file=sys.stderr, flush=True)

    def raise_if_set(self) -> None:
        if self.signum is not None:
            raise StopRequested(self.signum)
