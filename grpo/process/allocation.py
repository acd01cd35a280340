"""What each process of a run trains, scores and generates on: ``DeviceAllocation``, the GPU ids per model that
``grpo.process.devices.allocate_devices`` decides, and the view of it each data-parallel rank takes (``for_rank``)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace

import torch

from grpo.process.errors import DeviceAllocationError

ROLES = ("train", "ref", "inference")
RAY_ASSIGNED = -1  # placed_by_ray: this process's GPU, until ``on_gpu`` names the one Ray gave it


@dataclass
class DeviceAllocation:
    """Logical GPU ids per model; ``cpu=True`` (and empty lists) when the run uses no GPU."""

    train: list[int]
    ref: list[int]
    inference: list[int]
    cpu: bool = False
    colocated: bool = False  # train and inference share a GPU
    num_visible: int = 0
    gpu_memory_utilization: float | None = None
    notes: dict[str, str] = field(default_factory=dict)
    generating_ranks: int = 1  # sync: how many trainer ranks generate, each on its own engine (1: rank 0 alone)
    # a Ray cluster places each rank and worker (async, ray.address): ``train`` and ``ref`` name this process's GPU
    # (``on_gpu``), ``inference`` only counts the workers' GPUs (each generates on the one Ray assigns it)
    placed_by_ray: bool = False

    def torch_device(self, role: str) -> torch.device:
        """The first GPU of ``role`` ("train", "ref" or "inference"), or the CPU when it has none."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
        ids = getattr(self, role)
        return torch.device("cuda", ids[0]) if ids else torch.device("cpu")

    def for_rank(self, rank: int, size: int) -> DeviceAllocation:
        """What data-parallel rank ``rank`` of ``size`` trains on: its own train GPU, and one whole reference, beside
        it where the reference shares the train GPUs, else on reference GPU ``rank % len(ref)``; where every rank
        generates, its own inference GPU, the ``rank``-th. The CPU: this allocation (every rank a gloo process on
        the CPU)."""
        if self.cpu or self.placed_by_ray:  # placed by Ray: already this rank's own (``on_gpu``)
            return self
        if len(self.train) != size:
            raise DeviceAllocationError(f"{size} trainer rank(s) started but train_model has {len(self.train)} GPU(s) "
                                        f"{ids_text(self.train)}: each rank trains on one. "
                                        f"Fix: train_model.num_devices={size}")
        own = [self.train[rank]]
        ref = own if self.ref == self.train else self.ref[rank % len(self.ref):][:1]
        inference = self.inference[rank:][:1] if self.generating_ranks > 1 else self.inference
        return replace(self, train=own, ref=ref, inference=inference)

    def on_gpu(self, gpu: int) -> DeviceAllocation:
        """A ``placed_by_ray`` allocation made the one of the process Ray gave ``gpu`` (rank 0: the GPU its lease holds
        on its node; another rank: its actor's): it trains there, with its reference beside it."""
        if not self.placed_by_ray:
            raise ValueError("on_gpu: only a Ray cluster's allocation (placed_by_ray) takes the GPU Ray gave a rank")
        return replace(self, train=[gpu], ref=[gpu] if self.ref else [])

    def current_gpu(self, rank: int, size: int) -> int | None:
        """The GPU rank ``rank`` of ``size`` makes its current device, however it was launched (``LOCAL_RANK`` has
        no say): its own train GPU (``for_rank``), where FSDP2 puts its shards and NCCL sends from; None on the CPU."""
        return None if self.cpu else self.for_rank(rank, size).train[0]

    def torch_devices(self, role: str) -> list[torch.device]:
        """Every GPU of ``role``, or ``[cpu]`` when it has none."""
        return [torch.device("cuda", i) for i in getattr(self, role)] or [self.torch_device(role)]

    def describe(self) -> str:
        cuda_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        head = f"Devices ({self.num_visible} GPU(s) visible"
        head += f", CUDA_VISIBLE_DEVICES={cuda_visible})" if cuda_visible else ")"
        if self.cpu:
            return f"{head}\n  every model on the CPU (allow_cpu=true)"
        if self.placed_by_ray:  # described once ``on_gpu`` named this process's GPU
            return "\n".join([head, f"  train      gpu {self.train[0]:<8}  {self.notes['train']}",
                              f"  ref        {self.notes['ref']}", f"  inference  {self.notes['inference']}"])
        lines = [head]
        for role in ROLES:
            gpus = ",".join(map(str, getattr(self, role))) or "-"
            lines.append(f"  {role:<9}  gpu {gpus:<8}  {self.notes.get(role, '')}".rstrip())
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return asdict(self)


def ids_text(ids) -> str:
    return "[" + ",".join(map(str, ids)) + "]"
