"""GPU allocation for the train, reference and inference models.

``allocate_devices(cfg, visible_gpus=None, mode="sync")`` turns the
``train_model`` / ``ref_model`` / ``inference_model`` config sections into a
:class:`DeviceAllocation` (lists of *logical* GPU ids per model).  It is a pure
function: it loads nothing and touches no GPU, so it runs first and every
misconfiguration fails fast with a :class:`DeviceAllocationError` (a
``ValueError``) whose message names the model(s), the GPU ids, the number of
visible GPUs and the exact Hydra override that fixes it.

GPU ids
    Logical ids ``0..n-1`` as torch sees them, i.e. indexes into
    ``CUDA_VISIBLE_DEVICES`` when it is set (``CUDA_VISIBLE_DEVICES=4,5`` ->
    logical 0 is physical 4).  :func:`visible_gpu_ids` lists them,
    :func:`physical_id` maps a logical id back to the ``CUDA_VISIBLE_DEVICES``
    entry.  ``visible_gpus`` may be given explicitly (an int ``n`` meaning
    ``[0..n-1]``, or a list of ids); ``None`` detects with
    ``torch.cuda.device_count()``.

Config keys read (all optional, missing == null/false)
    ``{train,ref,inference}_model.num_devices`` (int) and ``.devices`` (list of
    ids), ``ref_model.colocate``, ``inference_model.colocate``,
    ``inference_model.gpu_memory_utilization``, ``train.use_kl_to_ref``
    (default true) and ``allow_cpu`` (top level; ``device.allow_cpu`` is
    accepted as a fallback).

Rules
    1. Per model, ``num_devices`` and ``devices`` are exclusive (both set ->
       error).  ``num_devices`` must be an int >= 1; ``devices`` ids must be
       visible and not repeated.  Neither set: train and inference get 1 GPU.
    2. Explicit ``devices`` are honoured and claimed first.  ``num_devices``
       (or the default of 1) are then filled greedily, in visible order, from
       the GPUs nobody claimed: train first, then inference, then ref.
    3. ``train.use_kl_to_ref=false``: no reference model, ref gets nothing
       (its ``ref_model`` keys are ignored).
    4. Ref placement: ``ref_model.colocate=true`` with no ``devices`` puts ref
       on the train GPUs (all of them, or the first ``num_devices``).  With
       neither key set, ref takes a free GPU when one is left, otherwise it
       falls back to the train GPUs ("GPUs short").  An explicit ref request
       (``devices`` or ``num_devices``) that overlaps train needs
       ``ref_model.colocate=true``; ref may never sit on an inference GPU
       unless that GPU is also a train GPU that both may share.
    5. async: training and inference never share a GPU.  1 visible GPU ->
       error ("async needs >= 2 GPUs, or use the sync script");
       ``inference_model.colocate=true`` -> error.
    6. sync, exactly 1 visible GPU: everything shares GPU 0
       (``colocated=True``); inference memory is capped by
       ``inference_model.gpu_memory_utilization`` (recorded in the
       allocation; the inference engine applies it).
    7. sync, >= 2 GPUs: train and inference get distinct GPUs.  Sharing
       (same id in both ``devices``, or inference placed on the train GPUs)
       requires ``inference_model.colocate=true``; otherwise it is an error,
       and so is running out of free GPUs for inference.
       ``DeviceAllocation.colocated`` is true whenever train and inference
       share a GPU (always the case in single-GPU sync).
    8. 0 visible GPUs: ``allow_cpu=true`` -> everything on CPU (``cpu=True``,
       all lists empty, GPU placement keys are validated but otherwise
       ignored); else error ("set allow_cpu=true or run on a GPU machine").
       With >= 1 GPU ``allow_cpu`` changes nothing.
    9. ``inference_model.gpu_memory_utilization``, when set, must be in
       (0, 1].
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "DeviceAllocation",
    "DeviceAllocationError",
    "ROLES",
    "allocate_devices",
    "physical_id",
    "visible_gpu_ids",
]

ROLES = ("train", "ref", "inference")
_ROLE_ALIASES = {
    "train": "train",
    "train_model": "train",
    "training": "train",
    "policy": "train",
    "ref": "ref",
    "ref_model": "ref",
    "reference": "ref",
    "inference": "inference",
    "inference_model": "inference",
    "vllm": "inference",
}
_MODES = ("sync", "async")


class DeviceAllocationError(ValueError):
    """Invalid device request; raised before any model is loaded."""


# ---------------------------------------------------------------------------
# Visible GPUs / CUDA_VISIBLE_DEVICES
# ---------------------------------------------------------------------------


def _cuda_visible_entries(env: str | None = None) -> list[str] | None:
    """Entries of CUDA_VISIBLE_DEVICES (None when unset).

    Mirrors the CUDA runtime: the list is cut at the first negative entry.
    """
    raw = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if raw is None:
        return None
    out: list[str] = []
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            if int(item) < 0:
                break
        except ValueError:
            pass  # UUID ("GPU-...") or MIG id: kept verbatim
        out.append(item)
    return out


def visible_gpu_ids() -> list[int]:
    """Logical ids of the visible GPUs, ``[0..torch.cuda.device_count()-1]``.

    Logical id ``i`` is the i-th entry of ``CUDA_VISIBLE_DEVICES`` when set.
    Returns ``[]`` when CUDA is unavailable.
    """
    try:
        n = int(torch.cuda.device_count())
    except Exception:  # pragma: no cover - broken driver etc.
        n = 0
    return list(range(max(n, 0)))


def physical_id(logical: int, env: str | None = None) -> int | str:
    """Map a logical GPU id to its ``CUDA_VISIBLE_DEVICES`` entry.

    Returns ``logical`` unchanged when ``CUDA_VISIBLE_DEVICES`` is unset, an
    int for numeric entries and the raw string for UUID/MIG entries.  ``env``
    overrides the environment variable (for tests).
    """
    if isinstance(logical, bool) or not isinstance(logical, int) or logical < 0:
        raise DeviceAllocationError(f"physical_id: logical GPU id must be an int >= 0, got {logical!r}")
    entries = _cuda_visible_entries(env)
    if entries is None:
        return logical
    if logical >= len(entries):
        raise DeviceAllocationError(
            f"physical_id: logical GPU {logical} is not visible "
            f"(CUDA_VISIBLE_DEVICES={','.join(entries)!s} has {len(entries)} entries)"
        )
    entry = entries[logical]
    try:
        return int(entry)
    except ValueError:
        return entry


# ---------------------------------------------------------------------------
# Result
# ---------------------------------------------------------------------------


def _fmt_ids(ids: list[int] | tuple[int, ...]) -> str:
    """Hydra-friendly list literal: ``[0,1]``."""
    return "[" + ",".join(str(i) for i in ids) + "]"


@dataclass
class DeviceAllocation:
    """Logical GPU ids per model.  Empty lists + ``cpu=True`` means CPU run."""

    train: list[int]
    ref: list[int]
    inference: list[int]
    colocated: bool = False  # train and inference share a GPU (sync only)
    cpu: bool = False
    mode: str = "sync"
    num_visible: int = 0
    ref_enabled: bool = True
    gpu_memory_utilization: float | None = None
    physical: dict[int, int | str] = field(default_factory=dict)  # only when CUDA_VISIBLE_DEVICES is set
    notes: dict[str, str] = field(default_factory=dict)

    def devices(self, role: str) -> list[int]:
        return list(getattr(self, _role(role)))

    def torch_device(self, role: str) -> torch.device:
        """First GPU of ``role`` as ``torch.device("cuda:i")``, else cpu."""
        ids = self.devices(role)
        if self.cpu or not ids:
            return torch.device("cpu")
        return torch.device("cuda", ids[0])

    def shared_with(self, role: str) -> list[str]:
        """Other roles that have at least one GPU in common with ``role``."""
        role = _role(role)
        mine = set(getattr(self, role))
        return [r for r in ROLES if r != role and mine & set(getattr(self, r))]

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly summary for logging."""
        return {
            "mode": self.mode,
            "cpu": self.cpu,
            "colocated": self.colocated,
            "num_visible": self.num_visible,
            "ref_enabled": self.ref_enabled,
            "train": list(self.train),
            "ref": list(self.ref),
            "inference": list(self.inference),
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "physical": {str(k): v for k, v in self.physical.items()},
            "notes": dict(self.notes),
        }

    def describe(self) -> str:
        """Readable multi-line table (printed once at start-up)."""
        head = f"Device allocation (mode={self.mode}, {self.num_visible} visible GPU(s)"
        if self.physical:
            head += ", CUDA_VISIBLE_DEVICES=" + ",".join(str(self.physical[k]) for k in sorted(self.physical))
        head += ")"
        if self.cpu:
            lines = [head, "  all models on CPU (allow_cpu=true, no GPU visible)"]
            lines += [f"  {k}: {v}" for k, v in self.notes.items()]
            return "\n".join(lines)
        show_phys = bool(self.physical)
        rows = [["role", "gpus"] + (["physical"] if show_phys else []) + ["torch device", "notes"]]
        for r in ROLES:
            ids = getattr(self, r)
            notes = []
            shared = self.shared_with(r)
            if shared:
                notes.append("shares with " + ", ".join(shared))
            if r in self.notes:
                notes.append(self.notes[r])
            row = [r, ",".join(map(str, ids)) if ids else "-"]
            if show_phys:
                row.append(",".join(str(self.physical.get(i, "?")) for i in ids) if ids else "-")
            row += [str(self.torch_device(r)) if ids else "-", "; ".join(notes)]
            rows.append(row)
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        lines = [head]
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:  # pragma: no cover - convenience
        return self.describe()


def _role(role: str) -> str:
    try:
        return _ROLE_ALIASES[role]
    except (KeyError, TypeError):
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}") from None


# ---------------------------------------------------------------------------
# Config parsing
# ---------------------------------------------------------------------------


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """``obj.key`` for DictConfig/dict/namespace; missing or ``???`` -> default."""
    if obj is None:
        return default
    try:
        if isinstance(obj, Mapping):
            value = obj.get(key, default)
        else:
            value = getattr(obj, key, default)
    except Exception:  # omegaconf MissingMandatoryValue, struct errors...
        return default
    return default if value is None else value


@dataclass
class _Req:
    role: str
    num: int | None
    devices: list[int] | None
    colocate: bool

    @property
    def key(self) -> str:
        return f"{self.role}_model"

    @property
    def specified(self) -> bool:
        return self.num is not None or self.devices is not None


def _to_bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise DeviceAllocationError(f"{name} must be true or false, got {value!r}. Fix: {name}=true or {name}=false")


def _parse_req(cfg: Any, role: str, n_visible: int) -> _Req:
    key = f"{role}_model"
    section = _get(cfg, key)
    num = _get(section, "num_devices")
    devices = _get(section, "devices")
    colocate = _to_bool(_get(section, "colocate"), f"{key}.colocate")
    vis = f"{n_visible} GPU(s) visible"

    if num is not None and devices is not None:
        raise DeviceAllocationError(
            f"{key}: num_devices={num!r} and devices={_fmt_list(devices)} are both set ({vis}); they are exclusive. "
            f"Fix: {key}.num_devices=null (keep devices) or {key}.devices=null (keep num_devices)"
        )
    if num is not None:
        if isinstance(num, bool) or not isinstance(num, int):
            raise DeviceAllocationError(
                f"{key}.num_devices must be an int >= 1, got {num!r} ({vis}). Fix: {key}.num_devices=1"
            )
        if num <= 0:
            raise DeviceAllocationError(
                f"{key}.num_devices={num} must be >= 1 ({vis}). "
                f"Fix: {key}.num_devices=1 (or {key}.num_devices=null for the default)"
            )
    if devices is not None:
        if isinstance(devices, int) and not isinstance(devices, bool):
            devices = [devices]
        try:
            devices = list(devices)
        except TypeError:
            devices = None
        if devices is None or isinstance(_get(section, "devices"), str) or any(
            isinstance(d, bool) or not isinstance(d, int) for d in devices
        ):
            raise DeviceAllocationError(
                f"{key}.devices must be a list of GPU ids, got {_get(section, 'devices')!r} ({vis}). "
                f"Fix: {key}.devices=[0] or {key}.devices=null"
            )
        if not devices:
            raise DeviceAllocationError(
                f"{key}.devices=[] requests no GPU ({vis}). Fix: {key}.devices=null (use num_devices) "
                f"or {key}.devices=[0]"
            )
        dups = sorted({d for d in devices if devices.count(d) > 1})
        if dups:
            dedup = list(dict.fromkeys(devices))
            raise DeviceAllocationError(
                f"{key}.devices={_fmt_ids(devices)} lists GPU id(s) {dups} more than once ({vis}). "
                f"Fix: {key}.devices={_fmt_ids(dedup)}"
            )
    return _Req(role=role, num=num, devices=devices, colocate=colocate)


def _fmt_list(value: Any) -> str:
    try:
        return _fmt_ids(list(value))
    except TypeError:
        return repr(value)


def _resolve_visible(visible_gpus: int | list[int] | None) -> list[int]:
    if visible_gpus is None:
        return visible_gpu_ids()
    if isinstance(visible_gpus, bool):
        raise DeviceAllocationError(f"visible_gpus must be an int or a list of ids, got {visible_gpus!r}")
    if isinstance(visible_gpus, int):
        if visible_gpus < 0:
            raise DeviceAllocationError(f"visible_gpus must be >= 0, got {visible_gpus}")
        return list(range(visible_gpus))
    ids = list(visible_gpus)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise DeviceAllocationError(f"visible_gpus must be distinct ints >= 0, got {visible_gpus!r}")
    return ids


def _physical_map(visible: list[int]) -> dict[int, int | str]:
    entries = _cuda_visible_entries()
    if entries is None:
        return {}
    out: dict[int, int | str] = {}
    for i in visible:
        try:
            out[i] = physical_id(i)
        except DeviceAllocationError:
            pass
    return out


# ---------------------------------------------------------------------------
# Allocation
# ---------------------------------------------------------------------------


def allocate_devices(
    cfg: Any,
    visible_gpus: int | list[int] | None = None,
    mode: str = "sync",
) -> DeviceAllocation:
    """Assign logical GPU ids to the train, reference and inference models.

    See the module docstring for the rules.  Raises
    :class:`DeviceAllocationError` on any invalid request.
    """
    if mode not in _MODES:
        raise DeviceAllocationError(f"mode must be 'sync' or 'async', got {mode!r}")
    visible = _resolve_visible(visible_gpus)
    n = len(visible)
    vis = f"{n} GPU(s) visible"

    ref_enabled = _to_bool(_get(_get(cfg, "train"), "use_kl_to_ref", True), "train.use_kl_to_ref")
    train = _parse_req(cfg, "train", n)
    inf = _parse_req(cfg, "inference", n)
    ref = _parse_req(cfg, "ref", n) if ref_enabled else _Req("ref", None, None, False)

    gmu = _get(_get(cfg, "inference_model"), "gpu_memory_utilization")
    if gmu is not None:
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0 < float(gmu) <= 1:
            raise DeviceAllocationError(
                f"inference_model.gpu_memory_utilization={gmu!r} must be in (0, 1] ({vis}). "
                f"Fix: inference_model.gpu_memory_utilization=0.5"
            )
        gmu = float(gmu)

    allow_cpu = _get(cfg, "allow_cpu")
    if allow_cpu is None:
        allow_cpu = _get(_get(cfg, "device"), "allow_cpu")
    allow_cpu = _to_bool(allow_cpu, "allow_cpu")

    physical = _physical_map(visible)
    notes: dict[str, str] = {}
    if not ref_enabled:
        notes["ref"] = "disabled (train.use_kl_to_ref=false)"

    # -- no GPU -------------------------------------------------------------
    if n == 0:
        if not allow_cpu:
            cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
            extra = f", CUDA_VISIBLE_DEVICES={cvd!r}" if cvd is not None else ""
            raise DeviceAllocationError(
                f"No GPU visible (0 GPUs{extra}) for train_model/ref_model/inference_model in {mode} mode. "
                f"Fix: allow_cpu=true (tiny CPU runs only) or run on a GPU machine"
            )
        ignored = [r.key for r in (train, inf, ref) if r.specified]
        if ignored:
            notes["cpu"] = "GPU placement of " + ", ".join(ignored) + " ignored (no GPU visible)"
        return DeviceAllocation(
            train=[], ref=[], inference=[], colocated=False, cpu=True, mode=mode, num_visible=0,
            ref_enabled=ref_enabled, gpu_memory_utilization=gmu, physical={}, notes=notes,
        )

    # -- mode-level constraints ------------------------------------------------
    if mode == "async":
        if n < 2:
            raise DeviceAllocationError(
                f"async mode needs >= 2 GPUs: train_model and inference_model never share a GPU, but only {vis} "
                f"(ids {visible}). Fix: use the sync script (mode=sync, colocates everything on one GPU) "
                f"or make >= 2 GPUs visible (CUDA_VISIBLE_DEVICES=0,1)"
            )
        if inf.colocate:
            raise DeviceAllocationError(
                f"inference_model.colocate=true is not allowed in async mode: train_model and inference_model "
                f"never share a GPU ({vis}). Fix: inference_model.colocate=false (or use the sync script)"
            )

    single_sync = mode == "sync" and n == 1
    inf_share_ok = mode == "sync" and (inf.colocate or single_sync)

    # -- explicit devices: range checks -----------------------------------------
    vset = set(visible)
    for r in (train, inf, ref):
        if r.devices is None:
            continue
        bad = [d for d in r.devices if d not in vset]
        if bad:
            good = [d for d in r.devices if d in vset]
            fix = f"{r.key}.devices={_fmt_ids(good)}" if good else f"{r.key}.devices={_fmt_ids(visible[:1])}"
            raise DeviceAllocationError(
                f"{r.key}.devices={_fmt_ids(r.devices)}: GPU id(s) {bad} out of range, {vis} "
                f"(logical ids {_fmt_ids(visible)}, i.e. indexes into CUDA_VISIBLE_DEVICES). "
                f"Fix: {fix} or {r.key}.devices=null"
            )

    # -- explicit overlaps, checked before filling so the message is precise --
    explicit = {r.role: list(r.devices or []) for r in (train, inf, ref)}
    _check_overlaps(explicit, train, inf, ref, visible, mode, inf_share_ok, ref_share_ok=ref.colocate or single_sync)

    # -- greedy fill ---------------------------------------------------------------
    claimed = set().union(*(set(v) for v in explicit.values()))
    pool = [g for g in visible if g not in claimed]
    out: dict[str, list[int]] = {}

    def take(r: _Req, k: int) -> list[int]:
        if k > len(pool):
            # when train is short, leave one GPU for inference unless it is explicit or may share
            reserve = int(r.role == "train" and inf.devices is None and not inf_share_ok)
            raise DeviceAllocationError(_short_message(r, k, pool, out, explicit, visible, mode, reserve))
        got = pool[:k]
        del pool[:k]
        return got

    def from_train(r: _Req, k: int, why: str) -> list[int]:
        tr = out["train"]
        if k > len(tr):
            fixes = [f"{r.key}.num_devices={len(tr)}"]
            # growing train only helps if the other models still fit next to it
            inf_ids = out.get("inference", [])
            others = len(inf_ids) if r.role == "ref" and not set(inf_ids) & set(tr) else 0
            if train.devices is None and k + others <= n:
                fixes.append(f"train_model.num_devices={k}")
            raise DeviceAllocationError(
                f"{r.key} needs {k} GPU(s) on the train GPUs ({why}) but train_model has only {len(tr)} "
                f"{_fmt_ids(tr)} ({vis}). Fix: " + " or ".join(fixes)
            )
        return tr[:k]

    # train
    out["train"] = list(train.devices) if train.devices is not None else take(train, train.num or 1)

    # inference
    if inf.devices is not None:
        out["inference"] = list(inf.devices)
    elif mode == "sync" and inf.colocate:
        out["inference"] = from_train(inf, inf.num or 1, "inference_model.colocate=true")
    elif single_sync and len(pool) < (inf.num or 1):
        out["inference"] = from_train(inf, inf.num or 1, "sync mode with 1 visible GPU")
    else:
        out["inference"] = take(inf, inf.num or 1)

    # ref
    ref_fallback = False
    if not ref_enabled:
        out["ref"] = []
    elif ref.devices is not None:
        out["ref"] = list(ref.devices)
    elif ref.colocate:
        out["ref"] = from_train(ref, ref.num or len(out["train"]), "ref_model.colocate=true")
        notes["ref"] = "on train GPU(s) (ref_model.colocate=true)"
    elif len(pool) >= (ref.num or 1):
        out["ref"] = take(ref, ref.num or 1)
    elif ref.num is None or single_sync:
        out["ref"] = from_train(ref, ref.num or len(out["train"]), "no free GPU left")
        ref_fallback = True
        notes["ref"] = "on train GPU(s): no free GPU left"
    else:
        out["ref"] = take(ref, ref.num)  # raises the "short" error

    _check_overlaps(
        out, train, inf, ref, visible, mode, inf_share_ok,
        ref_share_ok=ref.colocate or single_sync or ref_fallback,
    )

    colocated = bool(set(out["train"]) & set(out["inference"]))
    if colocated:
        cap = f"gpu_memory_utilization={gmu}" if gmu is not None else "gpu_memory_utilization (unset)"
        notes["inference"] = f"colocated: memory capped by {cap}"
    elif gmu is not None:
        notes["inference"] = f"gpu_memory_utilization={gmu}"

    return DeviceAllocation(
        train=out["train"], ref=out["ref"], inference=out["inference"], colocated=colocated, cpu=False,
        mode=mode, num_visible=n, ref_enabled=ref_enabled, gpu_memory_utilization=gmu, physical=physical,
        notes=notes,
    )


def _check_overlaps(
    lists: dict[str, list[int]],
    train: _Req,
    inf: _Req,
    ref: _Req,
    visible: list[int],
    mode: str,
    inf_share_ok: bool,
    ref_share_ok: bool,
) -> None:
    n = len(visible)
    vis = f"{n} GPU(s) visible"
    t, i, r = (set(lists.get(k, [])) for k in ("train", "inference", "ref"))
    used = t | i | r
    free = [g for g in visible if g not in used]

    def move_fix(req: _Req, ids: list[int], shared: list[int]) -> list[str]:
        """Overrides that take ``shared`` away from ``req``: swap in free GPUs, or drop them."""
        keep = [g for g in ids if g not in shared]
        out = []
        if len(free) >= len(shared):
            out.append(f"{req.key}.devices={_fmt_ids(keep + free[: len(shared)])}")
        if keep:
            out.append(f"{req.key}.devices={_fmt_ids(keep)}")
        return out or [f"{req.key}.devices=null"]

    ti = sorted(t & i)
    if ti and not inf_share_ok:
        moves = move_fix(inf, lists["inference"], ti) + move_fix(train, lists["train"], ti)
        if any(not m.endswith("=null") for m in moves):
            moves = [m for m in moves if not m.endswith("=null")]
        if mode == "async":
            why = "async mode: train_model and inference_model never share a GPU"
            fixes = moves
        else:
            why = "sync mode with >= 2 GPUs shares train/inference only on request"
            fixes = ["inference_model.colocate=true"] + moves
        raise DeviceAllocationError(
            f"GPU(s) {ti} given to both train_model (devices={_fmt_ids(lists['train'])}) and inference_model "
            f"(devices={_fmt_ids(lists['inference'])}); {why} ({vis}). Fix: " + " or ".join(dict.fromkeys(fixes))
        )
    tr = sorted(t & r)
    if tr and not ref_share_ok:
        raise DeviceAllocationError(
            f"GPU(s) {tr} given to both train_model (devices={_fmt_ids(lists['train'])}) and ref_model "
            f"(devices={_fmt_ids(lists['ref'])}) without ref_model.colocate ({vis}). "
            f"Fix: ref_model.colocate=true or " + " or ".join(move_fix(ref, lists["ref"], tr))
        )
    ri = sorted(r & i)
    if ri and not (set(ri) <= t and inf_share_ok and ref_share_ok):
        fixes = move_fix(ref, lists["ref"], ri)
        if mode == "sync" and n >= 2:
            fixes.append("ref_model.colocate=true (ref on the train GPUs)")
        raise DeviceAllocationError(
            f"GPU(s) {ri} given to both ref_model (devices={_fmt_ids(lists['ref'])}) and inference_model "
            f"(devices={_fmt_ids(lists['inference'])}) in {mode} mode ({vis}); ref may only share GPUs with "
            f"train_model. Fix: " + " or ".join(fixes)
        )


def _short_message(
    r: _Req,
    k: int,
    pool: list[int],
    out: dict[str, list[int]],
    explicit: dict[str, list[int]],
    visible: list[int],
    mode: str,
    reserve: int = 0,
) -> str:
    n = len(visible)
    what = f"num_devices={r.num}" if r.num is not None else "default of 1"
    claimed = {f"{role}_model": ids for role, ids in {**explicit, **out}.items() if ids}
    taken = ", ".join(f"{key}={_fmt_ids(ids)}" for key, ids in claimed.items())
    if k > n:
        head = f"{r.key} requests {k} GPU(s) ({what}) but only {n} GPU(s) visible"
    else:
        head = (
            f"{r.key} needs {k} GPU(s) ({what}) but only {len(pool)} are free {_fmt_ids(pool)}, "
            f"{n} GPU(s) visible"
        )
    fixes: list[str] = []
    if len(pool) - reserve >= 1:
        fixes.append(f"{r.key}.num_devices={len(pool) - reserve}")
    if r.role == "inference":
        if mode == "sync":
            fixes.append("inference_model.colocate=true")
        tr = out.get("train", [])
        spare = len(tr) - (k - len(pool))
        if spare >= 1:
            if explicit.get("train"):
                fixes.append(f"train_model.devices={_fmt_ids(tr[:spare])}")
            else:
                fixes.append(f"train_model.num_devices={spare}")
        if explicit.get("ref"):
            fixes.append("ref_model.devices=null")
    elif r.role == "ref":
        fixes.append("ref_model.colocate=true")
        if r.num is not None:
            fixes.append("ref_model.num_devices=null")
    elif r.role == "train" and len(pool) - reserve < 1:
        others = [key for key in claimed if key != "train_model"]
        fixes += [f"{key}.devices=null" for key in others]
    if not fixes:
        fixes.append(f"{r.key}.num_devices=1")
    if mode == "async" and r.role in ("train", "inference"):
        note = "; async keeps train_model and inference_model on different GPUs"
    else:
        note = ""
    taken = f" (claimed: {taken})" if taken else ""
    return f"{head}{taken}{note}. Fix: " + " or ".join(dict.fromkeys(fixes))
