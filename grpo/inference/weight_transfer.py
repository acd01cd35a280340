"""Weights from the trainer to rollout workers' engines: through CUDA IPC where both sit on one host's GPUs,
through Ray's object store otherwise.

The object store path moves every weight to the host, pickles it and copies it back up in each worker: on
a 0.5B model 1 GB a push, whose 289 device-to-host copies on the trainer's stream were 37% of the trainer
GPU's busy time and slowed its reference scoring from 0.2 to 2 s a step (benchmarks/README.md). Through
CUDA IPC the trainer sends each weight's handle (a few hundred bytes) and the worker copies it GPU to GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
import torch
from torch.multiprocessing.reductions import reduce_tensor

from grpo.inference.generation import tensor_place, weights_checksum


class PublishedWeights:
    """One weights version as the trainer hands it to workers: ``message()`` is what one worker is sent.

    Through CUDA IPC the snapshot stays alive with this object, and each message shares it anew: torch
    counts one reference per handle made, which the receiving worker gives back once it has copied.
    """

    def __init__(self, snapshot: dict[str, torch.Tensor], version: int, cuda_ipc: bool):
        self.version = version
        self.checksum = weights_checksum(snapshot)  # where the weights are: on a GPU it takes milliseconds
        self._snapshot = snapshot if cuda_ipc else None
        self._host = None if cuda_ipc else ray.put({name: tensor.cpu() for name, tensor in snapshot.items()})

    def message(self):
        """IPC handles, or a reference to the host copy in Ray's object store (Ray hands the worker the dict)."""
        return CudaIpcWeights.of(self._snapshot) if self._host is None else self._host


@dataclass(frozen=True)
class CudaIpcWeights:
    """HF-named weights that stay on the trainer's GPU, sent as CUDA IPC handles."""
    names: dict[str, int]   # HF name -> index in ``handles``: a tied weight is one tensor under two names
    handles: list[tuple]    # torch's (rebuild function, arguments) for each distinct tensor

    @classmethod
    def of(cls, weights: dict[str, torch.Tensor]) -> CudaIpcWeights:
        index, handles, names = {}, [], {}
        for name, tensor in weights.items():
            place = tensor_place(tensor)
            if place not in index:
                index[place] = len(handles)
                handles.append(reduce_tensor(tensor))  # records an event: the worker's copy waits for our writes
            names[name] = index[place]
        return cls(names, handles)

    def copy_to(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The weights copied onto ``device`` (GPU to GPU), finished before returning, so the sender may
        then free or overwrite its tensors."""
        local = [rebuild(*args).to(device, copy=True) for rebuild, args in self.handles]
        torch.cuda.synchronize(device)
        return {name: local[i] for name, i in self.names.items()}


def one_host() -> bool:
    """Whether the Ray cluster this process joined is one machine: CUDA IPC handles open only on their host."""
    return sum(node["Alive"] for node in ray.nodes()) == 1


def receive(message, device: torch.device) -> dict[str, torch.Tensor]:
    """A worker's side of ``PublishedWeights.message``: HF-named weights it owns (GPU copies, or the host dict)."""
    return message.copy_to(device) if isinstance(message, CudaIpcWeights) else message
