"""Room on the run dir's disk for the run's checkpoints: checked at the start, and one checkpoint's worth held
all along, so that a disk that fills mid-run (another job's files, a growing log) cannot take it.

A full disk once failed the final checkpoint of a run that had room at its start: every step since the last
checkpoint was lost. ``HeldRoom`` keeps a file of one checkpoint's size in the run dir from the start; a save
lets go of it just before it writes and takes it back after, so the checkpoint due when the disk fills always
finds its room. When the room cannot be taken back, the run stops on the checkpoint it just wrote.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from grpo.loop.settings import RecordSettings
from grpo.process.errors import RunDirError
from grpo.training import checkpoint as ckpt

ROOM_FILE = ".checkpoint_room"  # hidden: no reader of a run dir lists it


def checkpoints_at_once(settings: RecordSettings, start_step: int, written: int) -> int:
    """The most checkpoints a run from ``start_step`` holds on disk at once, ``written`` (by a run it resumes)
    included: each new one is written before ``logging.keep_last`` prunes the oldest; at least one more."""
    freq, total = settings.checkpoint_frequency, settings.total_steps
    due = {s for s in range(start_step + 1, total + 1) if freq and s % freq == 0} | {total}
    keep_last = settings.keep_last
    return max(written + 1, min(keep_last, written + len(due) - 1) + 1 if keep_last else written + len(due))


def checkpoint_bytes(trainable_bytes: int) -> int:
    """The room a checkpoint's write asks for: weights and AdamW's two moments, plus RNG states and JSON (a save
    checks for its tensors and 1 MiB; the 2 MiB leaves some over)."""
    return 3 * trainable_bytes + 2 * 2**20


def check_room_at_start(settings: RecordSettings, run_dir: Path, start_step: int, trainable_bytes: int) -> None:
    """A disk that cannot hold the run's checkpoints (those it keeps, and the one being written) and its best
    weights (``logging.keep_best``: kept, and the next best being written) is refused now."""
    written = len(ckpt.list_checkpoints(run_dir / settings.checkpoint_dir))
    at_once = checkpoints_at_once(settings, start_step, written)
    best = 2 if settings.keep_best else 0  # the best weights kept, and the next best being written
    ckpt.check_free_space(run_dir, ((at_once - written) * 3 + best) * trainable_bytes,
                          f"this run's checkpoints (weights and AdamW, {at_once} on disk at once with "
                          f"logging.keep_last={settings.keep_last}"
                          f"{', and the weights twice for logging.keep_best' if best else ''})",
                          "run again (or point hydra.run.dir at a larger disk)")


class HeldRoom:
    """``size`` bytes of the disk of ``run_dir``, allocated to a file of its own until a checkpoint needs them."""

    def __init__(self, run_dir: Path, size: int):
        self.path, self.size = run_dir / ROOM_FILE, size
        self.held = False
        if not self.take():
            raise RunDirError(f"{run_dir} has no room for this run's next checkpoint ({ckpt.size_text(size)}); free "
                              "space on its disk (or point hydra.run.dir at a larger one), then run again.")

    def take(self) -> bool:
        """Allocate the room again (blocks, not a sparse file: posix_fallocate); False when the disk is full."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, self.size)
            finally:
                os.close(fd)
        except OSError as err:
            self.path.unlink(missing_ok=True)
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            return False
        self.held = True
        return True

    def release(self) -> None:
        self.path.unlink(missing_ok=True)
        self.held = False
