"""The data-parallel world a trainer rank lives in: its rank, how many ranks train, and the few
collectives the GRPO step needs. One process is a world of one, where every collective is the
identity, so the step reads the same on one rank or many (``grpo/training/step.py``).

Every rank holds the whole step's batch (a few MB of token ids) and trains on rows ``rank::size``
of each micro-batch, cut from the minibatch the same way on every rank: the ranks then run the same
number of forward/backward passes, which FSDP2's collectives need, and the loss is exact whatever
the number of ranks (each term a sum divided by the global minibatch's totals; gradients summed).

Rank 0 leads a run: it generates (in sync, every rank may generate its share: ``grpo.rollout.local_rollouts``),
evaluates and writes everything (metrics, samples, checkpoints, the export). The other ranks follow
(``Trainer.follow``): each waits for rank 0 to name the next collective
(a GRPO step on the batch it sends, a state gather for a checkpoint or a weight push, or the end of the
run), so a rank never needs to know the run's schedule, and a failure on rank 0 between collectives
still reaches the others as a stop.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @classmethod
    def from_env(cls) -> World:
        """The world this process trains in: the process group it joined already (rank 0 of the ranks
        ``grpo.process.launch`` starts), else the one ``torchrun``'s variables (RANK, WORLD_SIZE, MASTER_ADDR)
        name, joined here (``join_group``). Neither: a world of one."""
        if not dist.is_initialized():
            if int(os.environ.get("WORLD_SIZE", "1")) == 1:
                return cls()
            join_group()
        return cls(rank=dist.get_rank(), size=dist.get_world_size())

    @staticmethod
    def launched_main() -> bool:
        """Whether this process is rank 0 of what its launcher started (or runs alone), before any group is joined."""
        return os.environ.get("RANK", "0") == "0"

    @property
    def is_main(self) -> bool:
        """Rank 0: the one writer of metrics, samples, plots and checkpoints."""
        return self.rank == 0

    def share(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a micro-batch (every ``size``-th, from ``rank``): sorted by length, the
        rows are dealt out so each rank gets a like share of the tokens."""
        return rows[self.rank::self.size]

    def sum(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
        """The sum (or ``op``) over ranks (a new tensor)."""
        if self.size == 1:
            return tensor
        out = tensor.clone()
        dist.all_reduce(out, op=op)
        return out

    def from_main(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor on every rank (a random draw made once, e.g. the minibatch order)."""
        if self.size == 1:
            return tensor
        out = tensor.clone()
        dist.broadcast(out, src=0)
        return out

    def gather_shares(self, local: torch.Tensor, n_rows: int) -> torch.Tensor:
        """The ``[n_rows, ...]`` tensor whose rows ``r::size`` rank ``r`` computed as ``local``."""
        if self.size == 1:
            return local
        width = -(-n_rows // self.size)  # ranks may hold one row fewer: pad to gather equal shapes
        padded = torch.zeros((width, *local.shape[1:]), dtype=local.dtype, device=local.device)
        padded[:len(local)] = local
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded)
        out = torch.empty((n_rows, *local.shape[1:]), dtype=local.dtype)
        for rank, part in enumerate(parts):
            out[rank::self.size] = part[:len(range(rank, n_rows, self.size))].to(out.device)
        return out

    def gather_to_main(self, value) -> list | None:
        """Rank 0: every rank's ``value`` (any picklable object), in rank order; the other ranks: None."""
        if self.size == 1:
            return [value]
        values = [None] * self.size if self.is_main else None
        dist.gather_object(value, values, dst=0)
        return values

    def lead(self, command: str, *args) -> None:
        """Rank 0: name the collective every rank runs next, with its arguments; the other ranks wait for it
        in ``next_command``. Elsewhere (a follower running that command, a world of one): nothing."""
        if self.size > 1 and self.is_main:
            dist.broadcast_object_list([(command, args)], src=0)

    @contextlib.contextmanager
    def leading(self):
        """Rank 0's run: however it ends, the other ranks are told to stop, with its exit status."""
        status = 1
        try:
            yield
            status = 0
        except SystemExit as end:
            status = end.code if isinstance(end.code, int) else 1
            raise
        finally:
            with contextlib.suppress(RuntimeError):  # a rank that is gone already (its failure ended the run)
                self.lead("stop", status)

    def next_command(self) -> tuple[str, tuple]:
        """A rank other than 0: the next collective rank 0 leads (``lead``), as (command, args)."""
        message = [None]
        dist.broadcast_object_list(message, src=0)
        return message[0]

    def shard(self, scorer: torch.nn.Module, *, reshard_after_forward: bool = True,
              gather_dtype: torch.dtype | None = None) -> torch.nn.Module:
        """FSDP2 over the ranks: each decoder layer of ``scorer.model`` one unit, ``scorer`` (a
        ``ReplyLogProbs``) the root, holding the embeddings, final norm and LM head, tied or not.
        Gradients are summed, not averaged: each rank's loss is already its share of the global
        minibatch's sum. ``gather_dtype``: weights gathered and computed in it, gradients reduced in
        float32. A world of one: unchanged. The optimiser must be built after this."""
        if self.size == 1:
            return scorer
        options = {"reshard_after_forward": reshard_after_forward}
        if gather_dtype is not None:
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=gather_dtype, reduce_dtype=torch.float32)
        for layer in scorer.model.get_decoder().layers:
            fully_shard(layer, **options)
        fully_shard(scorer, **options)
        for unit in scorer.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)
                unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        return scorer


def join_group(**init) -> None:
    """Join the process group ``init`` (or the environment) describes: on GPUs, NCCL for GPU tensors and gloo for the
    rest (rank 0's pickled commands, the minibatch order, the reference log-probs), so a rank needs no GPU until the
    allocation rank 0 sends names its own (``DeviceAllocation.current_gpu``; GPU ``LOCAL_RANK`` would be the wrong one
    where ``train_model.devices`` names others); on CPU, gloo alone."""
    dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo", **init)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds parameters sharded over ranks (FSDP2's DTensors)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (DTensor) value made whole on every rank; a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole(state):
    """A (nested) state dict with every sharded tensor made whole on every rank (a collective when
    sharded): the form a checkpoint keeps, which any number of ranks can load."""
    if isinstance(state, dict):
        return {key: whole(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(whole(value) for value in state)
    return full(state) if isinstance(state, torch.Tensor) else state


def shard_like(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A whole tensor cut as ``like`` is sharded (this rank's shard); as it is when ``like`` is not sharded."""
    if isinstance(like, DTensor):
        return distribute_tensor(tensor.to(like.device, like.dtype), like.device_mesh, like.placements)
    return tensor


def set_gradient_sync(module: torch.nn.Module, enabled: bool) -> None:
    """FSDP2: reduce-scatter gradients after this backward (the minibatch's last micro-batch) or keep
    accumulating them unsharded; a module that is not sharded always holds its whole gradient."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(enabled)
