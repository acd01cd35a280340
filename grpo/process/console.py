"""What a run prints for its user: lines written through the progress bar, never into it."""

from __future__ import annotations

import sys

from tqdm import tqdm


def say(text: str, file=None) -> None:
    """``text`` on its own lines: the bar (on stderr) is cleared, the text written and flushed, then the bar redrawn.
    tqdm.write alone leaves stdout unflushed, and where a pipe or file block-buffers it (``| tee``, a job's log) the
    text then landed after the redrawn bar, in the middle of its line."""
    file = file or sys.stdout
    with tqdm.external_write_mode(file=file):
        file.write(text + "\n")
        file.flush()
