#!/usr/bin/env python
"""A training checkpoint's save and load at a model's size, and the two costs the save had in one H200 host's
py-spy profile (2026-11-30: 44 s for the 1.5B's 18 GB): the NaN/inf check and the file's digest, each against
the way it was done before, in one invocation.

    python benchmarks/bench_checkpoint.py --shape qwen2.5-1.5b --dir /root/keep/ckpt     # one GPU
    python benchmarks/bench_checkpoint.py --shape tiny-wide-vocab --device cpu --dir /tmp/ckpt

A random-init model of a ``bench_vs_trl`` shape (float32, as the trainer keeps its master weights) and AdamW state
of its size (two moments a weight, as after a step) are saved by ``grpo.training.checkpoint.save_checkpoint`` and
loaded back by ``load_checkpoint``. Printed, in two lines: seconds of the save and the load, the NaN/inf check on
the weights where they live (``non_finite``, one reduction a tensor) against the same on their CPU copies (before),
the file's block digest (``blocks_sha256``, a thread a block) against one sha256 of the whole file (before); then
the save's other parts alone: the tensors' copy to the host (also into pinned memory on a GPU), the write, its fsync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", help="a bench_vs_trl random-init shape")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--dir", required=True, help="a folder to write the checkpoint into (removed after)")
    return p.parse_args(argv)


def seconds(fn, device) -> tuple[float, object]:
    import torch

    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from bench_vs_trl import RANDOM_INIT_SHAPES
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.training import checkpoint as ckpt

    device, folder = torch.device(args.device), Path(args.dir)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**RANDOM_INIT_SHAPES[args.shape])).to(device, torch.float32)
    weights = ckpt.trainable_state_dict(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    for p in model.parameters():
        optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    state = {"model": weights, "optimizer": optimizer.state_dict(), "scheduler": {"last_epoch": 1}}
    size = sum(t.numel() * t.element_size() for t in weights.values()) * 3
    print(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "shape": args.shape, "tensor_gb": round(size / 1e9, 2)}), flush=True)

    shutil.rmtree(folder, ignore_errors=True)
    save_s, path = seconds(lambda: ckpt.save_checkpoint(folder, 1, state=state, counters={}, resolved_config={}),
                           device)
    load_s, loaded = seconds(lambda: ckpt.load_checkpoint(path), device)
    assert all(torch.equal(loaded["model"][name], t.cpu()) for name, t in weights.items())  # what was saved
    check_s, _ = seconds(lambda: ckpt.non_finite(weights), device)
    copies = {name: t.to("cpu", copy=True) for name, t in weights.items()}
    check_cpu_s, _ = seconds(lambda: [n for n, t in copies.items() if not bool(t.isfinite().all())], device)
    tensors_file = next(folder.glob("step_*.safetensors"))
    blocks_s, _ = seconds(lambda: ckpt.blocks_sha256(tensors_file), device)
    whole_s, _ = seconds(lambda: ckpt._sha256(tensors_file), device)
    print(json.dumps({"save_s": round(save_s, 2), "load_s": round(load_s, 2),
                      "non_finite_where_they_live_s": round(check_s, 3),
                      "non_finite_cpu_copies_s": round(check_cpu_s, 3),
                      "blocks_sha256_s": round(blocks_s, 2), "whole_file_sha256_s": round(whole_s, 2),
                      "file_gb": round(tensors_file.stat().st_size / 1e9, 2)}), flush=True)
    # the save's other parts, each alone: the tensors' copy to the host (as the save makes it, and into pinned
    # memory, queued), the file's write, its fsync
    flat = {**{f"model/{k}": t for k, t in weights.items()},
            **{f"optimizer/{i}/{k}": t for i, st in optimizer.state.items() for k, t in st.items() if t.dim()}}
    del copies, loaded
    copy_s, host = seconds(lambda: {k: t.to("cpu", copy=True).contiguous() for k, t in flat.items()}, device)
    del host
    pinned_copy_s = None
    if device.type == "cuda":
        def pinned():
            out = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in flat.items()}
            for k, t in flat.items():
                out[k].copy_(t, non_blocking=True)
            return out
        pinned_copy_s, host = seconds(pinned, device)
    else:
        host = {k: t.to("cpu", copy=True).contiguous() for k, t in flat.items()}
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    write_s, _ = seconds(lambda: save_file(host, folder / "alone.safetensors"), device)
    with open(folder / "alone.safetensors", "rb") as f:
        fsync_s, _ = seconds(lambda: os.fsync(f.fileno()), device)
    print(json.dumps({"copy_to_host_s": round(copy_s, 2),
                      "pinned_copy_to_host_s": pinned_copy_s and round(pinned_copy_s, 2),
                      "write_s": round(write_s, 2), "fsync_s": round(fsync_s, 2)}), flush=True)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
