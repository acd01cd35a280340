"""Task data: loading a split from a hub name or a local path, and the prompt stream's position.

TorchRL's dataset envs call ``datasets.load_dataset(name, config)``, which only
understands hub names (a local jsonl fails with ``BuilderConfig 'main' not found``).
``load_split`` accepts both, so runs work offline on the files the project ships.

``PositionedLoader`` counts the prompt batches an env has drawn; a checkpoint stores that
count (``data_position``) and a resumed run skips to it (``skip_to_position``).
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pyarrow
import torch
from torch.utils.data import DataLoader
from torchrl.envs import Compose
from torchrl.envs.llm.transforms import DataLoadingPrimer

from grpo.errors import DataError

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def looks_local(name_or_path: str) -> bool:
    """Paths (absolute, relative with a separator, or existing) are local; `org/name` is a hub id."""
    p = Path(name_or_path).expanduser()
    return p.exists() or name_or_path.startswith((".", "/", "~")) or p.suffix in LOCAL_SUFFIXES


def _split_file(folder: Path, split: str) -> Path | None:
    for suffix in LOCAL_SUFFIXES:
        candidate = folder / f"{split}{suffix}"
        if candidate.exists():
            return candidate
    return None


def _read_file(path: Path, key: str, name_or_path: str) -> datasets.Dataset:
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
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise DataError(
                f"{key}={name_or_path!r}: no such file or folder. Give an existing local path "
                f"(jsonl/parquet/csv file, a folder with {split}.jsonl, or a datasets.save_to_disk "
                "folder) or a hub name such as openai/gsm8k."
            )
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
        raise DataError(f"{key}={name_or_path!r} split {split!r}: {err}; save the file as UTF-8.") from err
    return ds


class PositionedLoader:
    """A seeded DataLoader that counts the batches it yields across epochs.

    The count is the data position a checkpoint stores: a resumed run rebuilds the loader
    with the same seed and skips that many batches, so it sees the same prompts in the same
    order as a run that was never stopped.
    """

    def __init__(self, ds, *, seed, batch_size_dl, shuffle, collate_fn):
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.loader = DataLoader(ds, batch_size=batch_size_dl, shuffle=shuffle, collate_fn=collate_fn,
                                 generator=generator)
        self.position = 0

    def __iter__(self):
        for batch in self.loader:
            self.position += 1
            yield batch

    def __len__(self):
        return len(self.loader)


def data_primer(env) -> DataLoadingPrimer:
    """The env's DataLoadingPrimer (the transform that draws prompts)."""
    transforms = env.transform if isinstance(env.transform, Compose) else [env.transform]
    return next(t for t in transforms if isinstance(t, DataLoadingPrimer))


def data_position(env) -> int:
    return data_primer(env).dataloader.position


def skip_to_position(env, position: int) -> None:
    """Advance a freshly built env's prompt stream to ``position`` batches drawn.

    A new env has already drawn (and queued, ``repeats`` times) its first prompt while
    building its specs; a checkpoint is taken with that queue empty (whole groups per
    reset), so the queue is emptied before skipping.
    """
    primer = data_primer(env)
    primer._queue.clear()
    while primer.dataloader.position < position:
        next(primer.endless_dataloader)
