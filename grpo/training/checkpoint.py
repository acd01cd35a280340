"""Checkpoints: trainable weights (or only LoRA adapters), optimiser, LR schedule, counters, RNG
states and the resolved config, in a form that cannot run code when loaded.

On disk, ``step_N.json`` holds everything that is not a tensor and names ``step_N.<hash>.safetensors``,
which holds the tensors, with their digest (``blocks_sha256``). The JSON is written last, by an atomic
rename: it is the commit, so a reader sees the old set of files or the new complete checkpoint. Older versions wrote
pickled ``step_N.pt`` files; those are never loaded, since unpickling can run arbitrary code.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from grpo.process.errors import CheckpointError, ResumeError
from grpo.process.world import shard_like, whole

CKPT_PATTERN = re.compile(r"^step_(\d+)\.json$")
TENSORS_PATTERN = re.compile(r"^step_(\d+)\.[0-9a-f]+\.safetensors$")
# JSON stand-ins for what it cannot hold: a tensor (named in the safetensors file), a tuple, a dict
# with non-string keys (optimiser state is keyed by parameter index)
TENSOR, TUPLE, ITEMS = "__tensor__", "__tuple__", "__items__"
PICKLED = ("pickled checkpoints (step_*.pt, written by older versions) are not loaded: unpickling can run "
           "arbitrary code")
FRESH = "resume from a step_*.json checkpoint, or start without resume."


def trainable_state_dict(model) -> dict:
    """Only what training changes: every weight of a full fine-tune, the adapters of a LoRA one."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in names}


def training_state(model, optimizer, scheduler) -> dict:
    """What a checkpoint keeps of training: the trained weights, the optimiser and the schedule, whole
    (a data-parallel policy's shards gathered on every rank), so any number of ranks can resume it."""
    return {"model": whole(trainable_state_dict(model)), "optimizer": whole(optimizer.state_dict()),
            "scheduler": scheduler.state_dict()}


def rng_state() -> dict:
    kind, key, *rest = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, torch.from_numpy(key.copy()), *rest),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, key, *rest = state["numpy"]
    np.random.set_state((kind, key.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_json(obj, tensors: dict, key: str):
    """``obj`` as JSON values; each tensor goes into ``tensors`` (a CPU copy of its own) under its path."""
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()  # safetensors refuses shared storage
        return {TENSOR: key}
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _to_json(v, tensors, f"{key}/{k}") for k, v in obj.items()}
        return {ITEMS: [[k, _to_json(v, tensors, f"{key}/{k}")] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [_to_json(v, tensors, f"{key}/{i}") for i, v in enumerate(obj)]
        return {TUPLE: items} if isinstance(obj, tuple) else items
    return obj


def _from_json(obj, tensors: dict):
    if isinstance(obj, dict):
        if TENSOR in obj:
            return tensors[obj[TENSOR]]
        if TUPLE in obj:
            return tuple(_from_json(v, tensors) for v in obj[TUPLE])
        if ITEMS in obj:
            return {k: _from_json(v, tensors) for k, v in obj[ITEMS]}
        return {k: _from_json(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_json(v, tensors) for v in obj]
    return obj


def _sha256(path: Path) -> str:
    """The whole file's sha256: the digest checkpoints written before ``blocks_sha256`` carry."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


HASH_BLOCK = 1 << 26  # 64 MiB


def blocks_sha256(path: Path) -> str:
    """sha256 of the sha256s of the file's ``HASH_BLOCK``-byte blocks, hashed a thread a block (hashlib lets go of
    the GIL): the 1.5B's 18.5 GB checkpoint 16.7 s -> 1.9 s on a 16-core H200 host, at its save and again at its
    resume (``benchmarks/bench_checkpoint.py``, 2026-11-30)."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        def block(offset: int) -> bytes:
            return hashlib.sha256(os.pread(f.fileno(), HASH_BLOCK, offset)).digest()

        with ThreadPoolExecutor(min(32, os.cpu_count() or 1)) as pool:
            digests = list(pool.map(block, range(0, size, HASH_BLOCK)))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def _write_durably(path: Path, write) -> None:
    """``write(tmp)``, then fsync, so a rename that follows publishes complete bytes."""
    write(path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def non_finite(tensors: dict) -> list[str]:
    """The names of the floating-point tensors that hold a NaN or an inf, checked where they live with one read-back:
    the 1.5B's weights on their GPU 0.013 s, their CPU copies 1.4 s (``benchmarks/bench_checkpoint.py``)."""
    floats = [(name, t) for name, t in tensors.items() if t.is_floating_point()]
    if not floats:
        return []
    finite = torch.stack([t.isfinite().all().to(floats[0][1].device) for _, t in floats]).cpu()
    return [name for (name, _), ok in zip(floats, finite.tolist()) if not ok]


def size_text(size: int) -> str:
    """Bytes in GiB, or MiB under one GiB (a tiny model's checkpoint read "0.01 GiB")."""
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def check_free_space(folder: Path, need: int, what: str, then: str) -> None:
    """Refuse to start a write of ``need`` bytes into ``folder`` that its disk cannot hold; ``then``: what to do
    once there is room."""
    free = shutil.disk_usage(folder).free
    if free < need:
        raise CheckpointError(f"{what}: {size_text(need)} needed and {folder} has {size_text(free)} free; free "
                              f"{size_text(need - free)} there (older run dirs, logging.keep_last=1), then {then}.")


def save_checkpoint(ckpt_dir: Path, step: int, *, state: dict, counters: dict, resolved_config: dict,
                    extra: dict | None = None, keep_last: int | None = None, rng: dict | None = None,
                    then: str = "resume the run from its last checkpoint",
                    committed: Callable[[Path], None] | None = None) -> Path:
    """Write ``step_N.json`` and its tensors; returns the JSON's path. ``state``: ``training_state``'s.
    ``extra``: the scripts' own state, plain JSON values (loaded back as JSON gives them: tuples as
    lists). ``rng``: RNG states taken earlier (default: now). ``then``: what to do once there is room.
    ``committed``: called with the path the moment the JSON is in place, before the directory's fsync and the pruning
    (a Ctrl-C meanwhile was told "this run has no checkpoint" of a run whose checkpoint was on disk)."""
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    bad = non_finite(state["model"])
    if bad:  # a checkpoint of ruined weights would prune the good ones (keep_last)
        raise CheckpointError(f"step {step}: {len(bad)} weight tensor(s) hold NaN or inf (first: model/{bad[0]}); no "
                              f"checkpoint written, the earlier ones in {ckpt_dir} are kept.")
    tensors: dict = {}
    record = {
        "step": step,
        "model": _to_json(state["model"], tensors, "model"),
        "optimizer": _to_json(state["optimizer"], tensors, "optimizer"),
        "scheduler": _to_json(state["scheduler"], tensors, "scheduler"),
        "counters": counters,
        "rng": _to_json(rng or rng_state(), tensors, "rng"),
        "config": resolved_config,
    }
    for key, value in (extra or {}).items():
        if key in record or key == "tensors":
            raise ValueError(f"checkpoint extra {key!r} would overwrite the checkpoint's own {key!r}")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as err:
            raise TypeError(f"checkpoint extra {key!r} is not JSON-serialisable ({err}); checkpoints hold "
                            "plain numbers, strings, lists and dicts") from err
        record[key] = value
    for stale in ckpt_dir.glob("step_*.tmp"):  # left by a run killed mid-write
        stale.unlink()
    need = sum(t.numel() * t.element_size() for t in tensors.values()) + 2**20  # + the JSON, generously
    check_free_space(ckpt_dir, need, f"the checkpoint of step {step}", then)

    tmp, tensors_file = ckpt_dir / f"step_{step:08d}.safetensors.tmp", None
    path, json_tmp = ckpt_dir / f"step_{step:08d}.json", ckpt_dir / f"step_{step:08d}.json.tmp"
    try:
        _write_durably(tmp, lambda p: save_file(tensors, p))
        digest = blocks_sha256(tmp)
        tensors_file = ckpt_dir / f"step_{step:08d}.{digest[:16]}.safetensors"
        os.replace(tmp, tensors_file)  # a new name: the JSON of an earlier save of this step still points at its own
        record["tensors"] = {"file": tensors_file.name, "blocks_sha256": digest}
        _write_durably(json_tmp, lambda p: p.write_text(json.dumps(record, indent=1)))
    except (OSError, SafetensorError) as err:  # a full disk mid-write (safetensors: "No space left on device
        # (os error 28)" as a SafetensorError): free what was written, keep the older checkpoints
        tmp.unlink(missing_ok=True)
        json_tmp.unlink(missing_ok=True)
        if tensors_file is not None and not path.exists():  # named by no JSON (an earlier save's may be this file)
            tensors_file.unlink(missing_ok=True)
        kept = " The earlier checkpoints there are kept." if list_checkpoints(ckpt_dir) else ""
        raise CheckpointError(f"the checkpoint of step {step} could not be written to {ckpt_dir} ({err}); it needs "
                              f"{size_text(need)}; free that, then {then}.{kept}") from err
    os.replace(json_tmp, path)  # the commit
    if committed is not None:
        committed(path)
    dir_fd = os.open(ckpt_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the renames themselves survive a power cut
    finally:
        os.close(dir_fd)

    for old in list_checkpoints(ckpt_dir)[:-keep_last] if keep_last else []:
        old.unlink(missing_ok=True)
    committed = {int(CKPT_PATTERN.match(p.name).group(1)) for p in list_checkpoints(ckpt_dir)}
    for other in ckpt_dir.iterdir():  # tensors no JSON names any more: pruned, replaced, or never committed
        m = TENSORS_PATTERN.match(other.name)
        if m and other != tensors_file and (int(m.group(1)) == step or int(m.group(1)) not in committed):
            other.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict:
    """A checkpoint's contents, tensors in place, after checking its tensors against their sha256.
    A JSON file that is not one of ours comes back as it is, for ``check_resumable`` to refuse."""
    path = Path(path)
    record = json.loads(path.read_text())
    if not isinstance(record, dict) or "tensors" not in record:
        return record
    tensors = record.pop("tensors")
    name = tensors["file"]
    tensors_file = path.parent / name
    if not TENSORS_PATTERN.match(name):
        raise ValueError(f"names tensors {name!r}, not a step_*.safetensors file beside it")
    hashed, digest = ((blocks_sha256, tensors["blocks_sha256"]) if "blocks_sha256" in tensors
                      else (_sha256, tensors["sha256"]))
    if hashed(tensors_file) != digest:
        raise ValueError(f"{name} does not match its sha256: the file is damaged")
    return _from_json(record, load_file(tensors_file))


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The committed checkpoints (their JSON files), oldest first."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := CKPT_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def load_latest_good(ckpt_dir: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads; damaged ones are skipped with a warning."""
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return path, load_checkpoint(path)
        except Exception as err:  # bad JSON, missing or damaged tensors, ... all mean "not usable"
            warnings.warn(f"checkpoint {path} is unreadable ({type(err).__name__}: {err}); trying an older one")
    return None


def restore_training_state(payload: dict, *, model, optimizer, scheduler) -> None:
    """Weights, optimiser, schedule and RNG states of a checkpoint; a data-parallel policy takes its
    shards of the whole tensors the checkpoint holds, whatever the number of ranks that wrote it."""
    params = dict(model.named_parameters())
    weights = {k: shard_like(v, params[k]) if k in params else v for k, v in payload["model"].items()}
    try:
        _, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as err:  # size mismatch: another model shape than check_resumable could tell
        raise ResumeError(f"resume: the checkpoint's weights do not fit this model ({str(err).splitlines()[1:2]}); "
                          "resume with the model it was trained from.") from err
    if unexpected:
        raise ResumeError(f"resume: the checkpoint holds weights this model lacks ({unexpected[:5]}); resume with the "
                          "model it was trained from.")
    optimizer.load_state_dict(shard_optimizer_state(payload["optimizer"], optimizer))
    scheduler.load_state_dict(payload["scheduler"])
    set_rng_state(payload["rng"])


def shard_optimizer_state(saved: dict, optimizer) -> dict:
    """The optimiser's saved state with each per-parameter tensor (AdamW's moments) cut like its parameter."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, per_param in saved["state"].items():
        param = params[int(i)]
        state[i] = {name: shard_like(value, param) if torch.is_tensor(value) and value.shape == param.shape else value
                    for name, value in per_param.items()}
    return {**saved, "state": state}
