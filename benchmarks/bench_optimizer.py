#!/usr/bin/env python
"""One AdamW step on a model's parameters, torch's ``foreach`` against its ``fused`` implementation, in one invocation.

    python benchmarks/bench_optimizer.py --shape qwen2.5-1.5b                 # one GPU
    python benchmarks/bench_optimizer.py --shape tiny-wide-vocab --device cpu

The trainer takes ``--steps`` optimiser steps a GRPO step per minibatch (4 in the default job), each over every
float32 master weight: at the 1.5B shape 1.5e9 parameters, with their gradients and two AdamW moments, ~42 GB read
and written a step at the least. A random-init model of a ``bench_vs_trl`` shape gets random gradients; each
implementation runs ``--warmup`` steps, then ``--steps`` timed ones, from the same weights. It prints the seconds a
step, the GB/s of that least traffic, and the largest weight difference between the two after the same steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", help="a bench_vs_trl random-init shape")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    return p.parse_args(argv)


def timed_steps(params: list, grads: list, fused: bool, warmup: int, steps: int, device) -> tuple[float, list]:
    """Seconds a step of AdamW (the trainer's settings) over copies of ``params``, and the weights after."""
    import torch

    weights = [p.detach().clone().requires_grad_(True) for p in params]
    for w, g in zip(weights, grads):
        w.grad = g
    optimizer = torch.optim.AdamW(weights, lr=2e-6, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                                  foreach=not fused, fused=fused)
    for _ in range(warmup):
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / steps, weights


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from bench_vs_trl import RANDOM_INIT_SHAPES
    from transformers import Qwen2Config, Qwen2ForCausalLM

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**RANDOM_INIT_SHAPES[args.shape])).to(device, torch.float32)
    params = [p.detach() for p in model.parameters()]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    numel = sum(p.numel() for p in params)
    least_bytes = 7 * 4 * numel  # read weight, grad, 2 moments; write weight, 2 moments (float32)
    print(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "shape": args.shape, "parameters": numel}), flush=True)
    after = {}
    for name, fused in (("foreach", False), ("fused", True)):
        seconds, after[name] = timed_steps(params, grads, fused, args.warmup, args.steps, device)
        print(json.dumps({"implementation": name, "step_s": round(seconds, 4),
                          "least_traffic_gb_s": round(least_bytes / seconds / 1e9, 1)}), flush=True)
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(after["foreach"], after["fused"]))
    print(json.dumps({"max_weight_difference": diff}), flush=True)


if __name__ == "__main__":
    main()
