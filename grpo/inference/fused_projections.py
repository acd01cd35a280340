"""An inference copy's q/k/v and gate/up projections as one GEMM each: a decode step multiplies only a
batch of rows, so each small projection alone costs a launch and a barely filled kernel."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


class SharedGEMM:
    """Projections of one input (q/k/v; gate/up) as one GEMM. A decode step multiplies only ``batch``
    rows, so a small projection (k or v: 256 outputs at 1.5B) costs a launch and a barely filled
    kernel of its own. Their weights are copied into one tensor, and the projections' parameters
    become views of it: weight pushes copy into the parameters, so they write the fused weight too.
    A plain object, not a module: the fused tensor stays out of the state dict."""

    def __init__(self, linears: list[torch.nn.Linear]):
        self.weight = torch.cat([linear.weight.detach() for linear in linears])
        with_bias = linears[0].bias is not None
        self.bias = torch.cat([linear.bias.detach() for linear in linears]) if with_bias else None
        self.sizes = [linear.out_features for linear in linears]
        self.input, self.outputs, self.unread = None, (), 0

    def output(self, x, index: int):
        if x is not self.input:  # the first projection of this input computes them all
            self.input, self.outputs = x, F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
            self.unread = len(self.sizes)
        out, self.unread = self.outputs[index], self.unread - 1
        if self.unread == 0:  # all read: a prefill's outputs are large, 28 layers must not each keep theirs
            self.input, self.outputs = None, ()
        return out


class ProjectionOfShared(torch.nn.Module):
    """Stands in for one of ``SharedGEMM``'s linears: same parameter names, views of the fused weight."""

    def __init__(self, shared: SharedGEMM, index: int):
        super().__init__()
        self.shared, self.index = shared, index
        start, end = sum(shared.sizes[:index]), sum(shared.sizes[:index + 1])
        self.weight = torch.nn.Parameter(shared.weight[start:end], requires_grad=False)
        self.bias = None if shared.bias is None else torch.nn.Parameter(shared.bias[start:end], requires_grad=False)

    def forward(self, x):
        return self.shared.output(x, self.index)


# per decoder layer: the projections that read the same input
FUSABLE = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def fusable_groups(model):
    """``(module, names, linears)`` of each decoder layer's projections that read one input (``FUSABLE``), where all of
    them are plain linears (a LoRA-wrapped one is not)."""
    for layer in getattr(getattr(model, "model", None), "layers", []):
        for part, names in FUSABLE:
            module = getattr(layer, part, None)
            linears = [getattr(module, name, None) for name in names]
            if all(type(linear) is torch.nn.Linear for linear in linears):
                yield module, names, linears


def fuse_projections(model) -> int:
    """Each decoder layer's q/k/v and gate/up projections as one GEMM each (``SharedGEMM``), for a
    model that only generates: its gradients would reach the views, not the GEMM. Returns the number
    of projection groups fused (0 for architectures without these names)."""
    fused = 0
    for module, names, linears in fusable_groups(model):
        shared = SharedGEMM(linears)
        for index, name in enumerate(names):
            setattr(module, name, ProjectionOfShared(shared, index))
        fused += 1
    return fused


class FusedWhileSampling:
    """The same for a model that trains and samples (an engine sharing the policy on its GPU, in its dtype): its
    projections run as ``SharedGEMM``s while it samples (``swapped_in``) and are its own linears otherwise, which the
    gradients reach. The fused weights are copies, refreshed from the linears each time: one more copy of the q/k/v
    and gate/up weights (1.7 GB at 1.5B in bfloat16), copied in ~1 ms on an H100."""

    def __init__(self, model):
        self.groups = []
        for module, names, linears in fusable_groups(model):
            shared = SharedGEMM(linears)
            self.groups.append((module, names, linears, shared,
                                [ProjectionOfShared(shared, index) for index in range(len(names))]))

    @contextlib.contextmanager
    def swapped_in(self):
        with torch.no_grad():
            for module, names, linears, shared, stand_ins in self.groups:
                torch.cat([linear.weight for linear in linears], out=shared.weight)
                if shared.bias is not None:
                    torch.cat([linear.bias for linear in linears], out=shared.bias)
                for name, stand_in in zip(names, stand_ins):
                    setattr(module, name, stand_in)
        try:
            yield
        finally:
            for module, names, linears, _, _ in self.groups:
                for name, linear in zip(names, linears):
                    setattr(module, name, linear)
