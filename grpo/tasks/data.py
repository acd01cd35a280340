"""Task data: loading a split from a hub name or a local path, and the order prompts are drawn in.

TorchRL's dataset envs call ``datasets.load_dataset(name, config)``, which only
understands hub names (a local jsonl fails with ``BuilderConfig 'main' not found``).
``load_split`` accepts both, so runs work offline on the files the project ships.

``PromptStream`` fixes which prompts batch ``k`` holds, ``serve_from`` points an env at a batch,
and ``PromptLedger`` records which batches were consumed: the prompt-stream state a checkpoint
stores, so a resumed run trains each prompt as often as a run that was never stopped.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pyarrow
import torch
import grpo.process.torchrl_import  # noqa: F401 - first: TorchRL's LLM modules imported without vLLM (~3.5 s a process)
from torchrl.envs import Compose
from torchrl.envs.llm.transforms import DataLoadingPrimer

from grpo.process.errors import DataError, ResumeError
from grpo.tasks.paths import LOCAL_SUFFIXES, check_data_path, looks_local


def _split_file(folder: Path, split: str) -> Path | None:
    for suffix in LOCAL_SUFFIXES:
        candidate = folder / f"{split}{suffix}"
        if candidate.exists():
            return candidate
    return None


def _read_file(path: Path, key: str, name_or_path: str) -> datasets.Dataset:
    if path.stat().st_size == 0:  # datasets' own message for it is "StopIteration"
        raise DataError(f"{key}={name_or_path!r}: {path} is empty; put the split's rows there (one JSON object per "
                        "line for .jsonl).")
    try:
        return datasets.load_dataset(LOCAL_SUFFIXES.get(path.suffix, "json"), data_files=str(path), split="train")
    except Exception as err:  # datasets wraps the parser's error, whose message says what and where
        reason = err.__cause__ or err
        raise DataError(
            f"{key}={name_or_path!r}: cannot read {path} ({type(reason).__name__}: {str(reason)[:200]})."
        ) from err


def load_split(
    name_or_path: str,
    split: str,
    *,
    hub_config: str | None = None,
    required_fields: tuple[str, ...] = (),
    key: str = "env.dataset",
) -> datasets.Dataset:
    """One split of a data set, from the hub or from disk.

    Local forms: a file (``.jsonl``/``.json``/``.parquet``/``.csv``) used for every split,
    a folder holding ``{split}.jsonl`` (or .parquet/.csv), or a ``save_to_disk`` folder
    (a ``DatasetDict`` with that split, or a single ``Dataset``).
    """
    if looks_local(name_or_path):
        check_data_path(name_or_path, split, key)
        path = Path(name_or_path).expanduser()
        if path.is_file():
            ds = _read_file(path, key, name_or_path)
        elif (split_file := _split_file(path, split)) is not None:
            ds = _read_file(split_file, key, name_or_path)
        elif (path / "dataset_dict.json").exists() or (path / "dataset_info.json").exists():
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(
                        f"{key}={name_or_path!r} has splits {sorted(loaded)}, not {split!r}; "
                        "set env.train_split / env.test_split to one of them."
                    )
                loaded = loaded[split]
            ds = loaded
        else:
            raise DataError(
                f"{key}={name_or_path!r} is a folder without {split}.jsonl/.parquet/.csv and is not a "
                "datasets.save_to_disk folder; put the split files there or point at a file."
            )
    else:
        try:
            ds = datasets.load_dataset(name_or_path, hub_config, split=split)
        except Exception as err:  # the hub raises many types; the fix is the same
            raise DataError(
                f"{key}={name_or_path!r}: could not load split {split!r} from the Hugging Face hub "
                f"({type(err).__name__}: {str(err)[:200]}). Offline? Download it once and pass a local path."
            ) from err
    missing = [f for f in required_fields if f not in ds.column_names]
    if missing:
        raise DataError(
            f"{key}={name_or_path!r} split {split!r} lacks field(s) {missing}; it has {ds.column_names}."
        )
    if len(ds) == 0:
        raise DataError(f"{key}={name_or_path!r} split {split!r} is empty.")
    try:  # bytes that are not UTF-8 load fine and fail only when their row is drawn, mid-training
        ds.data.table.validate(full=True)
    except pyarrow.ArrowInvalid as err:
        where = _first_undecodable(ds.data.table)
        raise DataError(f"{key}={name_or_path!r} split {split!r}{where}: {err}; save the file as UTF-8.") from err
    return ds


def _first_undecodable(table) -> str:
    """`` row N, column 'c'`` of the first text that is not UTF-8 ("Column 0: In chunk 0: ... string index 50"
    named neither), or nothing when Arrow's complaint is another one."""
    for name in table.column_names:
        for i, value in enumerate(table.column(name)):
            try:
                value.as_py()
            except UnicodeDecodeError:
                return f" row {i}, column {name!r}"
    return ""


class PromptStream:
    """The order a run draws its prompts in, the same in both scripts and on every worker.

    Row positions 0, 1, 2, ... run through the split epoch after epoch, each epoch in its own
    order, drawn from ``(seed, epoch)`` (in file order when not shuffled). A batch of ``size``
    prompts is ``size`` consecutive positions, so batch ``k`` is a function of ``(seed, k)``
    alone: a resumed run or a restarted worker can build it without replaying the ones before.
    """

    def __init__(self, num_rows: int, *, seed: int, shuffle: bool = True):
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self._epoch, self._order = None, None

    def row(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_rows)
        if not self.shuffle:
            return offset
        if epoch != self._epoch:
            self._epoch, self._order = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)
        return int(self._order[offset])

    def batch(self, index: int, size: int) -> list[int]:
        return [self.row(index * size + i) for i in range(size)]


class StreamLoader:
    """What a ``DataLoadingPrimer`` draws from: one-row batches of ``rows`` at consecutive stream
    positions from ``position`` on, endlessly, each carrying its ``row_index`` (logged per step).
    ``share_of`` makes it one rank's share of each stream batch instead."""

    def __init__(self, rows, *, seed: int, shuffle: bool, collate_fn):
        self.rows, self.collate_fn = rows, collate_fn
        self.stream = PromptStream(len(rows), seed=seed, shuffle=shuffle)
        self.position = 0
        self.rank, self.ranks, self.share = 0, 1, 1

    def share_of(self, rank: int, ranks: int, batch_size: int) -> None:
        """Rank ``rank`` of ``ranks`` generating together: its batch ``k`` (``batch_size / ranks`` prompts) is the
        ``rank``-th of ``ranks`` equal parts of the stream's batch ``k`` of ``batch_size`` prompts."""
        if batch_size % ranks:
            raise ValueError(f"a batch of {batch_size} prompts does not split over {ranks} ranks")
        self.rank, self.ranks, self.share = rank, ranks, batch_size // ranks

    def stream_position(self, position: int) -> int:
        """Where this loader's ``position``-th prompt sits in the stream."""
        batch, offset = divmod(position, self.share)
        return (batch * self.ranks + self.rank) * self.share + offset

    def __iter__(self):
        while True:  # reads self.position each time: serve_from moves it between draws
            row = self.stream.row(self.stream_position(self.position))
            self.position += 1
            batch = self.collate_fn([self.rows[row]])
            batch.set("row_index", torch.tensor([row]))
            yield batch


def data_primer(env) -> DataLoadingPrimer:
    """The env's DataLoadingPrimer (the transform that draws prompts)."""
    transforms = env.transform if isinstance(env.transform, Compose) else [env.transform]
    return next(t for t in transforms if isinstance(t, DataLoadingPrimer))


def serve_from(env, collector, batch_index: int) -> None:
    """Make the collector's next env batch stream batch ``batch_index``, and the ones after it follow.

    An env batch is ``num_envs / repeats`` prompts. Whatever the env and collector drew before
    (building them draws a batch: the primer's spec probe and the collector's first reset) is
    dropped, not trained, so a run's first step trains the batch it was told to.
    """
    primer = data_primer(env)
    primer._queue.clear()
    primer.dataloader.position = batch_index * (env.batch_size[0] // max(1, primer.repeats))
    collector._shuttle = None  # the next collection resets the env, drawing from that position


class PromptLedger:
    """Which stream batches a run has consumed: the JSON state its checkpoints store.

    Batches are handed out by index (``take``); a batch is consumed once the step that trained it,
    or dropped it as too stale, completed (``consume``). The state is ``next_batch`` (every batch
    below it was handed out) and ``pending`` (those among them not consumed: in flight, or lost with
    a worker, or taken by a step that never completed), which are handed out again first.
    """

    def __init__(self, state: dict | None = None):
        state = state or {"next_batch": 0, "pending": []}
        self.next_batch = int(state["next_batch"])
        self.queued = sorted(int(i) for i in state["pending"])  # served before next_batch
        self.out: set[int] = set()

    @classmethod
    def from_checkpoint(cls, payload: dict | None) -> PromptLedger:
        if payload is None:
            return cls()
        if "prompt_stream" not in payload:
            raise ResumeError("resume: the checkpoint holds no prompt-stream state (written by an older version), so "
                              "the prompts it trained are unknown; start without resume.")
        return cls(payload["prompt_stream"])

    def sequential_start(self) -> int:
        """Where a run that draws batches strictly in order (the sync script) starts: the pending
        batches must then be the last ones handed out, as the sync script leaves them."""
        start = self.queued[0] if self.queued else self.next_batch
        if self.queued != list(range(start, self.next_batch)):
            raise ResumeError(f"resume: the checkpoint has prompt batches {self.queued} in flight out of order "
                              "(written by grpo-async.py); the sync script draws batches in order, so resume it with "
                              "grpo-async.py.")
        return start

    def take(self) -> int:
        if self.queued:
            index = self.queued.pop(0)
        else:
            index, self.next_batch = self.next_batch, self.next_batch + 1
        self.out.add(index)
        return index

    def release(self, indices) -> None:
        """Handed out but lost (a dead worker's): they are handed out again before any new batch."""
        self.out.difference_update(indices)
        self.queued = sorted({*self.queued, *indices})

    def consume(self, indices) -> None:
        self.out.difference_update(indices)

    def state(self) -> dict:
        return {"next_batch": self.next_batch, "pending": sorted({*self.queued, *self.out})}
