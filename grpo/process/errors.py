"""Every mistake a user can make in a config, a data set, a model path or a resume target.

Each is a ``UserError`` whose message says what was wrong and what to do; ``clear_errors``, the
one handler around both scripts, prints that message and exits with status 2, no traceback.
Anything else (a bug, a crashed worker) keeps its traceback.
"""

from __future__ import annotations

import contextlib
import sys


class UserError(Exception):
    """A mistake the user can fix; the message names the key or file and the fix."""


class ConfigError(UserError, ValueError):
    """A config value that cannot work."""


class DeviceAllocationError(ConfigError):
    """A GPU request that cannot be met; raised before any model is loaded."""


NO_GPU = ("No GPU visible for the train, ref and inference models. Fix: allow_cpu=true (tiny models only) or run on a "
          "GPU machine")  # grpo.process.devices.allocate_devices, and the scripts' command-line check before torch


class DataError(UserError, ValueError):
    """A data set that cannot be used: missing, unreadable, or a row that breaks the task's format."""


class ModelLoadError(UserError, RuntimeError):
    """The model or tokenizer named in the config cannot be loaded."""


class ResumeError(UserError, ValueError):
    """``resume=`` names nothing usable."""


class CheckpointError(UserError, OSError):
    """A checkpoint that must not or cannot be written: non-finite weights, or no room on its disk."""


class RunDirError(UserError, OSError):
    """A file of the run dir that cannot be written (a full disk, a folder removed): the run stops, its last
    checkpoint kept."""


class NonFiniteError(UserError, ArithmeticError):
    """A reward, loss or gradient that is not a finite number: the optimiser step it would feed is not taken."""


class RewardTimeout(UserError, TimeoutError):
    """A call of a user's reward function ran past ``reward.timeout_s``: the run stops rather than hang on it."""


class UserCodeError(UserError):
    """The user's code (a reward function, a turn env) raised or exited; ``frames``: its own traceback frames, the
    project's left out, printed above the one line."""

    def __init__(self, message: str, frames: str = ""):
        super().__init__(message)
        self.frames = frames

    def __reduce__(self):  # raised in a rollout worker, it reaches the trainer whole
        return type(self), (str(self), self.frames)


class ExportError(UserError, ValueError):
    """``python -m grpo.export`` got a checkpoint it cannot read or an output folder it must not fill."""


@contextlib.contextmanager
def clear_errors():
    """User mistakes end the run with one line on stderr and exit status 2."""
    try:
        yield
    except UserError as err:
        if isinstance(err, UserCodeError) and err.frames:  # where the user's code went wrong, theirs alone
            print(err.frames, end="", file=sys.stderr)
        # one line even when the message quotes a library's multi-line error (transformers' OSError)
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        sys.exit(2)
