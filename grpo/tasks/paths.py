"""Which names are local paths, where the run reads a relative one from (``resolve_local_paths``), and whether a
local model folder or data path is there: checks that import no torch, so the scripts run them on their
command line (``grpo.loop.config.validate_config``) before the ~9 s of imports, and the loaders run them again on
the names they are handed."""

from __future__ import annotations

from pathlib import Path

from grpo.process.config_keys import REPO_ROOT
from grpo.process.errors import DataError, ModelLoadError

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")


def from_repo_root(name: str) -> Path | None:
    """``REPO_ROOT / name`` where ``name`` is relative, not there from the working directory, but there: where the
    run reads it from, so the tiny configs run from anywhere."""
    path = Path(name)
    if not path.is_absolute() and not path.exists() and (REPO_ROOT / path).exists():
        return REPO_ROOT / path
    return None


def as_the_run_reads_it(name: str) -> Path:
    """``name`` from the working directory, else from the repo root (``resolve_local_paths``)."""
    return from_repo_root(name) or Path(name).expanduser()


def resolve_local_paths(cfg) -> None:
    """``model.name`` and ``env.dataset`` rewritten to the repo root's path where the run reads them from there."""
    for section, key in (("model", "name"), ("env", "dataset")):
        value = cfg[section][key]
        if isinstance(value, str) and (path := from_repo_root(value)):
            cfg[section][key] = str(path)


def looks_local(name_or_path: str) -> bool:
    """Paths (absolute, relative with a separator, or existing) are local; `org/name` is a hub id."""
    p = Path(name_or_path).expanduser()
    return p.exists() or name_or_path.startswith((".", "/", "~")) or p.suffix in LOCAL_SUFFIXES


def check_model_folder(name: str, key: str = "model.name") -> None:
    """A local model must be a folder with config.json, a tokenizer and weights: say which is missing
    (transformers' own error suggests going online, which is no help for a local folder)."""
    folder = as_the_run_reads_it(name)
    if not (looks_local(name) or folder.exists()):
        return
    if not folder.is_dir():
        raise ModelLoadError(
            f"{key}={name!r}: no such folder. Give a local folder holding config.json and the "
            "weights, or a hub name such as Qwen/Qwen2.5-0.5B-Instruct (needs network or a warm HF cache).")
    missing = [what for what, present in (
        ("config.json", (folder / "config.json").is_file()),
        ("a tokenizer (tokenizer.json or tokenizer_config.json)", any(folder.glob("tokenizer*"))),
        ("weights (*.safetensors or *.bin)", any(p for pattern in WEIGHT_FILES for p in folder.glob(pattern))),
    ) if not present]
    if missing:
        raise ModelLoadError(f"{key}={name!r}: the folder lacks {', '.join(missing)}; point at the folder "
                             "save_pretrained wrote (model and tokenizer).")


def check_data_path(name_or_path: str, split: str, key: str = "env.dataset") -> None:
    """A local data path must exist (what it holds is checked as it loads: ``grpo.tasks.data.load_split``)."""
    if looks_local(name_or_path) and not as_the_run_reads_it(name_or_path).exists():
        raise DataError(
            f"{key}={name_or_path!r}: no such file or folder. Give an existing local path "
            f"(jsonl/parquet/csv file, a folder with {split}.jsonl, or a datasets.save_to_disk "
            "folder) or a hub name such as openai/gsm8k.")
