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


def quiet_libraries() -> None:
    """Progress bars no user acts on: datasets' over a local file it converts ("Generating train split") and
    transformers' over weights read from disk ("Loading weights"); the run says what it loads instead. The hub's
    download bars stay: they explain a first run's long wait."""
    import datasets
    import huggingface_hub
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.enable_progress_bars()  # which transformers' call turned off
