"""GPU placement of the train, reference and inference models.

``allocate_devices`` turns the ``train_model`` / ``ref_model`` / ``inference_model`` config sections
into logical GPU ids (indexes into ``CUDA_VISIBLE_DEVICES``, as torch numbers them). It loads nothing,
so it runs first, and a request that cannot work stops the run with a one-line
``DeviceAllocationError`` naming the Hydra override that fixes it.

Explicit ``devices`` are claimed first; ``num_devices`` (default 1 for train and inference) is then
filled in visible order from the unclaimed GPUs: train, inference, ref. Training and inference share a
GPU only in sync runs: always on one GPU, else with ``inference_model.colocate=true``. Each inference
engine generates on one GPU, so inference never gets more GPUs than engines. The reference model
(only with ``train.use_kl_to_ref``) goes on the train GPUs with ``ref_model.colocate=true``, else on
free GPUs; without its own ``num_devices``/``devices`` it falls back to the train GPUs when none is
free. It never sits on a GPU that only inference uses.

In sync, rank 0 alone generates (one inference GPU, the default), or every trainer rank does, each on its own
engine (as many inference GPUs as ranks: rank ``r`` on the ``r``-th, its own train GPU with
``inference_model.colocate=true``; on the CPU, ``inference_model.num_devices`` = the rank count), each its share
of every prompt batch, whole prompts, so a batch's prompts must split evenly over them.

Each train GPU is one data-parallel trainer rank (``grpo.process.launch`` starts them), holding an FSDP2 shard
of the policy and one whole reference, so the reference never has more GPUs than training. With no GPU and
``allow_cpu=true``, ``train_model.num_devices=N`` is N gloo ranks on the CPU; the other keys are checked only.

In a Ray cluster (the async script with ``ray.address``) Ray places every process that holds a GPU, on any node:
the allocation then names no GPU of its own (``placed_by_ray``). It checks the counts, and each rank's
allocation names the GPU Ray gave that rank (``on_gpu``), its reference beside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from grpo.process.allocation import RAY_ASSIGNED, DeviceAllocation, ids_text
from grpo.process.errors import NO_GPU, DeviceAllocationError


@dataclass(frozen=True)
class DeviceRequest:
    """One model's GPUs as the config asks for them, unchecked: ``allocate_devices`` checks them."""
    key: str                        # its config section: train_model, ref_model or inference_model
    num_devices: object             # None, or how many GPUs
    devices: object                 # None, or which GPU ids
    colocate: object                # None: false

    @classmethod
    def from_config(cls, cfg, key: str) -> DeviceRequest:
        section = cfg.get(key) or {}
        return cls(key, section.get("num_devices"), section.get("devices"), section.get("colocate"))


@dataclass(frozen=True)
class PlacementSettings:
    """What GPU placement reads of the config, as composed: ``allocate_devices`` and ``trainer_ranks`` check it.
    A section or key missing reads as null."""
    train: DeviceRequest
    ref: DeviceRequest
    inference: DeviceRequest
    use_kl_to_ref: object           # train.use_kl_to_ref; None: true (the reference needs GPUs)
    gpu_memory_utilization: object  # inference_model's, in (0, 1]
    allow_cpu: object               # None: false
    num_envs: object                # env.num_envs and env.repeats: sync's generating ranks split a batch's prompts
    repeats: object

    @classmethod
    def from_config(cls, cfg) -> PlacementSettings:
        train, inference, env = cfg.get("train") or {}, cfg.get("inference_model") or {}, cfg.get("env") or {}
        return cls(train=DeviceRequest.from_config(cfg, "train_model"), ref=DeviceRequest.from_config(cfg, "ref_model"),
                   inference=DeviceRequest.from_config(cfg, "inference_model"),
                   use_kl_to_ref=train.get("use_kl_to_ref"),
                   gpu_memory_utilization=inference.get("gpu_memory_utilization"), allow_cpu=cfg.get("allow_cpu"),
                   num_envs=env.get("num_envs"), repeats=env.get("repeats"))


@dataclass
class _Request:
    """A ``DeviceRequest`` checked."""
    key: str  # config section, e.g. "train_model"
    num: int | None = None
    devices: list[int] | None = None
    colocate: bool = False

    @property
    def count(self) -> int:  # GPUs asked for
        return len(self.devices) if self.devices else self.num or 1

    def fewer(self, n: int) -> str:
        """The override that asks for ``n`` of these GPUs: the first ``n`` of its ``devices``, or ``num_devices``."""
        return f"{self.key}.devices={ids_text(self.devices[:n])}" if self.devices else f"{self.key}.num_devices={n}"


def _flag(value, name: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise DeviceAllocationError(f"{name}={value!r} must be true or false. Fix: {name}={str(default).lower()}")
    return value


def _checked(request: DeviceRequest) -> _Request:
    key, num, devices = request.key, request.num_devices, request.devices
    req = _Request(key, colocate=_flag(request.colocate, f"{key}.colocate", False))
    if num is not None and devices is not None:
        raise DeviceAllocationError(f"{key}.num_devices and {key}.devices are both set; they are exclusive. "
                                    f"Fix: {key}.num_devices=null (keep devices) or {key}.devices=null")
    if num is not None:
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise DeviceAllocationError(f"{key}.num_devices={num!r} must be an int >= 1. Fix: {key}.num_devices=1")
        req.num = num
    if devices is not None:
        if isinstance(devices, str) or not isinstance(devices, Sequence) or not devices or any(
                isinstance(i, bool) or not isinstance(i, int) for i in devices):
            raise DeviceAllocationError(f"{key}.devices={devices!r} must be a non-empty list of GPU ids like [0,1]. "
                                        f"Fix: {key}.devices=null")
        req.devices = list(devices)
        if len(set(req.devices)) < len(req.devices):
            raise DeviceAllocationError(f"{key}.devices={ids_text(req.devices)} names a GPU twice. "
                                        f"Fix: {key}.devices={ids_text(dict.fromkeys(req.devices))}")
    return req


def trainer_ranks(placement: PlacementSettings) -> int | None:
    """How many data-parallel trainer ranks ``train_model`` asks for: one per GPU of its ``devices`` or
    ``num_devices`` (with no GPU, as many gloo ranks on the CPU); ``None`` when it sets neither. A bad value is
    the one-line error ``allocate_devices`` gives."""
    req = _checked(placement.train)
    return req.count if req.num or req.devices else None


def _visible(visible_gpus: int | list[int] | None) -> list[int]:
    count = torch.cuda.device_count() if visible_gpus is None else visible_gpus
    ids = list(range(count)) if type(count) is int and count >= 0 else count
    if not isinstance(ids, list) or any(type(i) is not int or i < 0 for i in ids) or len(set(ids)) < len(ids):
        raise ValueError(f"visible_gpus must be a count or a list of distinct GPU ids, got {visible_gpus!r}")
    return ids


def allocate_devices(placement: PlacementSettings, *, inference_engines: int, dedicated_inference: bool,
                     placed_by_ray: bool = False, visible_gpus: int | list[int] | None = None) -> DeviceAllocation:
    """GPU ids for each model; ``visible_gpus=None`` counts the GPUs torch sees. ``inference_engines``: the most
    engines the script can start (async: its collectors; sync: one per trainer rank). ``placed_by_ray``: a Ray
    cluster places every rank and worker (``ray_placed``)."""
    if isinstance(inference_engines, bool) or not isinstance(inference_engines, int) or inference_engines < 1:
        raise ValueError(f"inference_engines must be an int >= 1, got {inference_engines!r}")
    visible = _visible(visible_gpus)
    n = len(visible)
    vis = f"{n} GPU(s) visible"
    use_ref = _flag(placement.use_kl_to_ref, "train.use_kl_to_ref", True)
    train, inf = _checked(placement.train), _checked(placement.inference)
    ref = _checked(placement.ref) if use_ref else _Request("ref_model")
    gmu = placement.gpu_memory_utilization
    if gmu is not None and (isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0 < gmu <= 1):
        raise DeviceAllocationError(f"inference_model.gpu_memory_utilization={gmu!r} must be in (0, 1]. "
                                    f"Fix: inference_model.gpu_memory_utilization=0.5")
    notes = {} if use_ref else {"ref": "no reference model (train.use_kl_to_ref=false)"}
    generating = 1 if dedicated_inference else _generating_ranks(placement, train, inf, inference_engines, vis)

    if n == 0:
        if not _flag(placement.allow_cpu, "allow_cpu", False):
            raise DeviceAllocationError(NO_GPU)
        return DeviceAllocation([], [], [], cpu=True, gpu_memory_utilization=gmu, notes=notes,
                                generating_ranks=generating)
    if placed_by_ray:
        return ray_placed(train, inf, ref if use_ref else None, inference_engines, gmu, notes, n)
    if dedicated_inference and n < 2:
        raise DeviceAllocationError(f"The async script keeps training and inference on separate GPUs but {vis}. "
                                    f"Fix: run the sync script (it shares one GPU) or make 2 GPUs visible")
    if dedicated_inference and inf.colocate:
        raise DeviceAllocationError(f"inference_model.colocate=true, but the async script never lets training and "
                                    f"inference share a GPU ({vis}). Fix: inference_model.colocate=false")
    for req in (train, inf, ref):
        bad = [i for i in req.devices or [] if i not in visible]
        if bad:
            good = [i for i in req.devices if i in visible]
            fix = f"{req.key}.devices={ids_text(good)} or " if good else ""
            raise DeviceAllocationError(f"{req.key}.devices={ids_text(req.devices)} names GPU(s) {ids_text(bad)} but "
                                        f"{vis} (ids {ids_text(visible)}). Fix: {fix}{req.key}.devices=null")

    # Unclaimed GPUs each model takes: none for inference on the train GPUs, nor for a ref that
    # may fall back to them. On one GPU (sync) every model shares it, so nothing is claimed.
    inf_shares = not dedicated_inference and (inf.colocate or n == 1)
    ref_on_train = use_ref and ref.devices is None and (ref.colocate or n == 1 or ref.num is None)
    pool = [i for i in visible if n == 1 or all(i not in (r.devices or []) for r in (train, inf, ref))]
    need = {"train_model": 0 if train.devices else train.count,
            "inference_model": 0 if inf.devices or inf_shares else inf.count,
            "ref_model": 0 if not use_ref or ref.devices or ref_on_train else ref.count}
    if dedicated_inference:
        _check_engines(inf, inference_engines, vis, fits=sum(need.values()) <= len(pool))
    if n > 1:
        has_spare = len(pool) > sum(need.values())  # an unclaimed GPU nobody needs
        _check_sharing(train, inf, ref, vis, has_spare, dedicated_inference, inf_shares, ref.colocate)
    on_train = [req for req, shares in ((inf, inf_shares and not inf.devices), (ref, ref_on_train and ref.num))
                if shares]  # these take the first of the train GPUs
    _check_enough(train, inf, ref, need, pool, vis, dedicated_inference, max([1] + [r.count for r in on_train]))
    for req in on_train:
        if req.count > train.count:
            fixes = [f"{req.key}.num_devices={train.count}"]
            if not train.devices and sum(need.values()) + req.count - train.count <= len(pool):
                fixes.append(f"train_model.num_devices={req.count}")
            raise DeviceAllocationError(f"{req.key} would share the train GPUs but asks for {req.count} and "
                                        f"train_model has {train.count} ({vis}). Fix: " + " or ".join(fixes))
    if use_ref and ref.count > train.count:  # its own GPUs: each rank holds one whole reference on one of them
        k, t = ref.count, train.count
        fix = ref.fewer(t)
        raise DeviceAllocationError(f"ref_model has {k} GPUs but train_model has {t}: each trainer rank holds one "
                                    f"whole reference model on one GPU, so {k - t} would idle ({vis}). Fix: {fix}")

    def take(k: int) -> list[int]:
        got = pool[:k]
        del pool[:k]
        return got

    train_ids = train.devices or take(train.count)
    inf_ids = inf.devices or (train_ids[:inf.count] if inf_shares else take(inf.count))
    if not use_ref:
        ref_ids = []
    elif ref.devices or not ref_on_train or (ref.num is None and not ref.colocate and pool):
        ref_ids = ref.devices or take(ref.num or 1)
    else:
        ref_ids = train_ids[:ref.num or len(train_ids)]
        notes["ref"] = "on the train GPUs" + (" (ref_model.colocate=true)" if ref.colocate else ": no free GPU left")
    colocated = bool(set(train_ids) & set(inf_ids))
    notes["inference"] = f"gpu_memory_utilization={gmu}" + ("; shares a GPU with training" if colocated else "")
    if generating > 1:
        notes["inference"] += f"; each of the {generating} trainer ranks generates on its own"
    return DeviceAllocation(list(train_ids), list(ref_ids), list(inf_ids), colocated=colocated, num_visible=n,
                            gpu_memory_utilization=gmu, notes=notes, generating_ranks=generating)


def _check_engines(inf: _Request, engines: int, vis: str, fits: bool) -> None:
    """Async: no more inference GPUs than rollout workers, one engine each (``fits``: the GPUs would hold as many
    workers as GPUs)."""
    if inf.count > engines:
        k, e = inf.count, engines
        fix = inf.fewer(e) + (f" or train.num_collectors={k}" if fits else "")
        raise DeviceAllocationError(f"inference_model has {k} GPUs but train.num_collectors={e} starts {e} generation "
                                    f"engine(s), one GPU each: {k - e} would idle ({vis}). Fix: {fix}")


def ray_placed(train: _Request, inf: _Request, ref: _Request | None, engines: int, gmu, notes: dict,
               visible: int) -> DeviceAllocation:
    """A Ray cluster's allocation (async, ``ray.address``): Ray gives each trainer rank a GPU on any node (rank 0
    one of the node it runs on: ``grpo.process.ray_placement.driver_gpu``) and each rollout worker its share of an
    inference GPU, so no config names a GPU id, and each rank holds its reference beside its policy
    (``ray_placement.check_cluster_gpus`` checks the cluster has the GPUs). ``ref``: None without a reference."""
    for req in (train, inf, ref or _Request("ref_model")):
        if req.devices:
            raise DeviceAllocationError(f"{req.key}.devices={ids_text(req.devices)} names GPUs of this node, but in a "
                                        f"Ray cluster (ray.address) Ray places every trainer rank and rollout worker "
                                        f"on the GPUs its nodes declare. Fix: {req.key}.devices=null "
                                        f"{req.key}.num_devices={len(req.devices)}")
    if ref is not None and (ref.num not in (None, train.count) or not ref.colocate):
        raise DeviceAllocationError(f"In a Ray cluster (ray.address) each trainer rank holds its reference model on "
                                    f"its own GPU, but ref_model asks for {ref.num or 1} GPU(s) of its own. "
                                    f"Fix: ref_model.num_devices=null ref_model.colocate=true")
    _check_engines(inf, engines, f"a Ray cluster; {visible} GPU(s) visible here", fits=True)
    notes |= {"train": f"{train.count} rank(s), each on a GPU Ray gives it (rank 0: one of this node's)",
              "inference": f"{inf.count} GPU(s) Ray gives the {engines} rollout worker(s); "
                           f"gpu_memory_utilization={gmu}"}
    notes.setdefault("ref", "beside each rank's policy, on its GPU")
    return DeviceAllocation([RAY_ASSIGNED], [RAY_ASSIGNED] if ref is not None else [], list(range(inf.count)),
                            num_visible=visible, gpu_memory_utilization=gmu, notes=notes, placed_by_ray=True)


def _generating_ranks(placement: PlacementSettings, train: _Request, inf: _Request, engines: int, vis: str) -> int:
    """Sync: 1 (rank 0 generates) or, with one inference GPU per trainer rank, every rank, each its share of every
    prompt batch by whole prompts. More inference GPUs than ranks is ``allocate_devices``' idle-GPU error."""
    k, t = inf.count, train.count
    if k > engines:
        fix = inf.fewer(engines)
        raise DeviceAllocationError(f"inference_model has {k} GPUs but sync generates with one engine on one GPU "
                                    f"(rank 0's) or one per trainer rank ({engines}): {k - engines} would idle "
                                    f"({vis}). Fix: {fix}, or run the async script with train.num_collectors={k}")
    if k == 1:
        return 1
    if k != t:
        raise DeviceAllocationError(f"inference_model has {k} GPUs but train_model has {t}: sync generates on rank 0 "
                                    f"alone (1 inference GPU) or on every trainer rank, one engine each ({vis}). "
                                    f"Fix: inference_model.num_devices=1 or inference_model.num_devices={t}")
    num_envs, repeats = placement.num_envs, placement.repeats
    if num_envs is not None and repeats and (num_envs // repeats) % k:
        prompts = num_envs // repeats
        fit = max(k, prompts // k * k) * repeats
        raise DeviceAllocationError(f"env.num_envs={num_envs} holds {prompts} prompts (x env.repeats={repeats}), "
                                    f"which {k} generating ranks cannot split by whole prompts. "
                                    f"Fix: env.num_envs={fit} or inference_model.num_devices=1")
    return k


def _check_sharing(train: _Request, inf: _Request, ref: _Request, vis: str, has_spare: bool,
                   dedicated: bool, inf_shares: bool, ref_shares: bool) -> None:
    """Explicit ``devices`` lists that overlap where the rules forbid it."""
    t, i, r = (set(req.devices or []) for req in (train, inf, ref))
    if t & i and not inf_shares:
        fixes = [] if dedicated else ["inference_model.colocate=true"]
        for req in (inf, train):
            keep = [g for g in req.devices if g not in t & i]
            if keep:
                fixes.append(f"{req.key}.devices={ids_text(keep)}")
        if has_spare or not fixes:
            fixes.append("inference_model.devices=null")
        why = "the async script never shares them" if dedicated else "sharing needs inference_model.colocate=true"
        raise DeviceAllocationError(f"train_model.devices={ids_text(train.devices)} and inference_model.devices="
                                    f"{ids_text(inf.devices)} share GPU(s) {ids_text(sorted(t & i))}: {why} ({vis}). "
                                    f"Fix: " + " or ".join(fixes))
    if t & r and not ref_shares:
        fix = "ref_model.colocate=true or " if not r & (i - t) else ""
        raise DeviceAllocationError(f"ref_model.devices={ids_text(ref.devices)} shares GPU(s) "
                                    f"{ids_text(sorted(t & r))} with train_model without ref_model.colocate=true "
                                    f"({vis}). "
                                    f"Fix: {fix}ref_model.devices=null")
    if r & i and not (r & i <= t and inf_shares and ref_shares):
        raise DeviceAllocationError(f"ref_model.devices={ids_text(ref.devices)} shares GPU(s) "
                                    f"{ids_text(sorted(r & i))} with inference_model; ref may only share the train "
                                    f"GPUs ({vis}). "
                                    f"Fix: ref_model.devices=null")


def _check_enough(train: _Request, inf: _Request, ref: _Request, need: dict[str, int], pool: list[int],
                  vis: str, dedicated: bool, train_min: int) -> None:
    """The unclaimed GPUs must cover every ``num_devices`` request; each fix alone makes them fit."""
    excess = sum(need.values()) - len(pool)
    if excess <= 0:
        return
    fixes = [f"{req.key}.num_devices={need[req.key] - excess}" for req in (train, inf, ref)
             if need[req.key] - excess >= (train_min if req is train else 1)]
    if need["inference_model"] >= excess and not dedicated and inf.count <= train.count:
        fixes.append("inference_model.colocate=true")
    if need["ref_model"] >= excess:
        fixes += ["ref_model.colocate=true"] if ref.count <= train.count else []
        fixes.append("ref_model.num_devices=null")
    fixes += [f"{req.key}.devices=null" for req in (train, inf, ref)
              if req.devices and len(req.devices) - (req is not ref) >= excess]
    if not fixes:  # several requests must shrink: back to the defaults
        fixes = [" ".join(f"{r.key}.num_devices=null" if r.num else f"{r.key}.devices=null"
                          for r in (train, inf, ref) if r.num or r.devices)]
    asks = ", ".join(f"{key} needs {k}" for key, k in need.items() if k)
    claimed = ", ".join(f"{r.key}.devices={ids_text(r.devices)}" for r in (train, inf, ref) if r.devices)
    raise DeviceAllocationError(f"Not enough GPUs: {asks}, but only {len(pool)} are unclaimed ({vis}"
                                + (f"; claimed: {claimed}" if claimed else "") + "). Fix: " + " or ".join(fixes))
