#!/usr/bin/env python
"""The LM head's per-token log-probs, forward and backward, by our chunked head and by the fused libraries
issue 67 names, in one invocation: ``token_log_probs``' head (``grpo.training.logprobs.chunked_head_log_probs``:
chunks each recomputed in backward; eager and compiled, as ``train_model.compile`` runs it), liger-kernel's fused
linear cross-entropy (``reduction="none"``) and cut-cross-entropy (exact: no gradient filter).

    python benchmarks/bench_lm_head.py                              # one GPU: 1.5B head, 16,384 reply tokens
    python benchmarks/bench_lm_head.py --device cpu --vocab 4096 --hidden 64 --tokens 512 --impls ours,ours_compiled

Each impl takes the same bf16 hidden states and bf16 head weight, scores ``--tokens`` targets at ``--temperature``
(folded into the hidden states for the libraries, which have no temperature: logits / T = (h / T) W^T), and
back-propagates random per-token gradients, as the GRPO loss hands them. Printed per impl: the median seconds of
``--repeats`` forward + backward calls, the peak memory above the inputs, and the largest difference of its log-probs
and gradients from ours (float32 logits). A library that is not installed, or has no CPU kernel, is reported as such.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--tokens", type=int, default=16384, help="reply tokens scored (a 32-reply micro-batch at ~512)")
    p.add_argument("--hidden", type=int, default=1536, help="hidden size (Qwen2.5-1.5B: 1536, 0.5B: 896)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen2.5: 151,936)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature the log-probs are of")
    p.add_argument("--impls", default="ours,ours_compiled,liger,cce",
                   help="comma list of impls: ours, ours_compiled, ours_compiled:<chunk MiB>[:entropy], liger, cce")
    p.add_argument("--repeats", type=int, default=5, help="timed forward + backward calls per impl")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def ours(compiled: bool, chunk_mib: int | None = None, with_entropy: bool = False):
    """Our head as ``token_log_probs`` runs it (``grpo.training.logprobs.chunked_head_log_probs``): chunks of the
    device's default size (or ``chunk_mib`` MiB of float32 logits), each recomputed in backward; ``with_entropy`` as
    the training forward (logged, no gradient), which the libraries do not compute."""
    from grpo.training.logprobs import chunked_head_log_probs, head_log_probs
    from grpo.training.models import compiled_with_grad

    head_fn = compiled_with_grad(head_log_probs) if compiled else head_log_probs

    def log_probs(hidden, head, targets, temperature):
        return chunked_head_log_probs(head, hidden, targets, temperature=temperature, with_entropy=with_entropy,
                                      entropy_grad=False, head_fn=head_fn,
                                      chunk_bytes=chunk_mib and chunk_mib * 2**20)[0]

    return log_probs


def liger():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def log_probs(hidden, head, targets, temperature):
        return -liger_fused_linear_cross_entropy(hidden / temperature, head.weight, targets, reduction="none")

    return log_probs


def cce():
    from cut_cross_entropy import linear_cross_entropy

    def log_probs(hidden, head, targets, temperature):
        return -linear_cross_entropy(hidden / temperature, head.weight, targets, reduction="none", filter_eps=None)

    return log_probs


IMPLS = {"ours": lambda: ours(False), "ours_compiled": lambda: ours(True), "liger": liger, "cce": cce}


def impl(name: str):
    """``IMPLS[name]``, or ``ours_compiled:<MiB>[:entropy]``: ours compiled with chunks of that many MiB of float32
    logits (0: the device's default), computing the entropy too if asked."""
    if name.startswith("ours_compiled:"):
        fields = name.split(":")
        return ours(True, int(fields[1]), with_entropy=fields[2:] == ["entropy"])
    return IMPLS[name]()


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch

    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    hidden = (torch.randn(args.tokens, args.hidden, generator=gen)).to(device, torch.bfloat16)
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False)  # the LM head, its weight trained
    with torch.no_grad():
        head.weight.copy_(torch.randn(args.vocab, args.hidden, generator=gen) * args.hidden ** -0.5)
    head = head.to(device, torch.bfloat16)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(device)
    upstream = torch.randn(args.tokens, generator=gen).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(json.dumps({"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                      "tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab}), flush=True)
    baseline = None
    for name in args.impls.split(","):
        try:
            fn = impl(name)
        except ImportError as err:
            print(json.dumps({"impl": name, "skipped": f"not installed ({err})"}), flush=True)
            continue

        def call():
            h = hidden.detach().requires_grad_()
            head.weight.grad = None
            lp = fn(h, head, targets, args.temperature)
            lp.float().backward(upstream)
            return lp.detach().float(), h.grad.float(), head.weight.grad.float()

        try:
            out = call()  # warm-up: compiles, autotunes
        except Exception as err:  # noqa: BLE001 - a library without this device's kernels is reported, not fatal
            print(json.dumps({"impl": name, "skipped": f"{type(err).__name__}: {str(err)[:200]}"}), flush=True)
            continue
        times = []
        for _ in range(args.repeats):
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            base_memory = torch.cuda.memory_allocated() if device.type == "cuda" else 0
            t0 = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - t0)
        row = {"impl": name, "seconds": round(statistics.median(times), 5),
               "peak_gb_above_inputs": round((torch.cuda.max_memory_allocated() - base_memory) / 1e9, 3)
               if device.type == "cuda" else None}
        if baseline is None:
            baseline = out
        else:
            for label, mine, theirs in zip(("log_prob", "grad_hidden", "grad_weight"), out, baseline):
                row[f"max_abs_diff_{label}"] = float((mine - theirs).abs().max())
                row[f"max_abs_{label}"] = float(theirs.abs().max())
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
