#!/usr/bin/env python
"""The train part of a GRPO step alone (``GRPOStep.optimize``), for several ways of cutting it, in one invocation.

    python benchmarks/bench_train_step.py --shape qwen2.5-1.5b --lengths cap,real            # one GPU
    python benchmarks/bench_train_step.py --device cpu --shape tiny-wide-vocab --replies 16 --max-new-tokens 32

A random-init model of a bench_vs_trl shape is loaded as the trainer loads its policy
(``grpo.training.models.load_policy_model`` with the default ``grpo_gsm8k`` config: float32 master weights,
bf16 autocast on a GPU) and trained on one synthetic rollout batch: ``--replies`` replies to prompts
of 90-160 tokens, group advantages, the sampler's log-probs equal to the model's own (on-policy).
Reply lengths are ``cap`` (every reply at ``--max-new-tokens``, as a random-init model writes) or
``real`` (spread like the real Qwen2.5-Coder-0.5B's GSM8K replies: mean ~300, 5% cut at the cap).

Each variant (``--variants``: ``ckpt=<share of layers recomputed, 0-1>,rows=<max rows>,tokens=<max tokens or 0>,
packed=<0|1>``; ``train_model.checkpoint_fraction``, ``train.packed_sequences``: tokens are real ones when packed,
padded ones otherwise) starts
from the same weights, runs one warm-up ``optimize`` and ``--repeats`` timed ones. It prints the
train part's seconds, the micro-batches per minibatch, the reply+prompt tokens trained, the model
FLOP/s (6 x parameters x tokens / s, recompute not counted, so checkpointing shows as a cost) and
the peak memory; the objective of the first timed call must agree across variants (the cut does not
change the loss; the relative spread is printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

DEFAULT_VARIANTS = "ckpt=1,rows=32,tokens=32768,packed=0;ckpt=1,rows=32,tokens=32768,packed=1;ckpt=0,rows=32,tokens=16384,packed=1"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen2.5-1.5b", help="a bench_vs_trl random-init shape")
    p.add_argument("--tokenizer", default="assets/tiny-model", help="tokenizer folder for the random-init model")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--replies", type=int, default=128, help="replies in the step (train.dialog_turns_per_batch)")
    p.add_argument("--group", type=int, default=8, help="replies per prompt (env.repeats)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="reply length cap")
    p.add_argument("--lengths", default="cap,real", help="comma list of reply length spreads: cap, real")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="';'-separated ckpt=..,rows=..,tokens=..")
    p.add_argument("--repeats", type=int, default=2, help="timed optimize calls per variant")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logit-chunk-mib", type=int, default=None,
                   help="the LM head's chunk on a GPU (grpo.training.logprobs.GPU_LOGIT_CHUNK_BYTES), in MiB of logits")
    p.add_argument("--profile", action="store_true",
                   help="after each variant's timed calls, one more under torch.profiler: its heaviest GPU kernels, "
                        "their time by kind and the share of the wall time the GPU was busy")
    return p.parse_args(argv)


def parse_variant(text: str) -> dict:
    fields = dict(part.split("=") for part in text.split(","))
    return {"ckpt": float(fields["ckpt"]), "rows": int(fields["rows"]), "tokens": int(fields["tokens"]) or None,
            "packed": bool(int(fields.get("packed", 0)))}


def reply_lengths(spread: str, n: int, cap: int, gen):
    """``cap``: every reply at the cap; ``real``: normal around 0.6 x cap (sd 0.18 x cap), 5% at the cap."""
    import torch

    if spread == "cap":
        return torch.full((n,), cap)
    lengths = (torch.randn(n, generator=gen) * 0.18 * cap + 0.6 * cap).round().clamp(16, cap - 1).long()
    lengths[torch.rand(n, generator=gen) < 0.05] = cap
    return lengths


def synthetic_batch(vocab: int, args, spread: str, pad_id: int):
    """A dense batch as ``grpo.training.batch.to_training_batch`` builds it, less the sampler's log-probs."""
    import torch
    from tensordict import TensorDict

    gen = torch.Generator().manual_seed(args.seed)
    n = args.replies
    prompt_len = torch.randint(90, 161, (n // args.group,), generator=gen).repeat_interleave(args.group)
    reply_len = reply_lengths(spread, n, args.max_new_tokens, gen)
    width_p, width_r = int(prompt_len.max()), int(reply_len.max())
    cols = torch.arange(width_p + width_r)
    attention_mask = (cols >= width_p - prompt_len[:, None]) & (cols < width_p + reply_len[:, None])
    input_ids = torch.randint(0, vocab, (n, width_p + width_r), generator=gen).masked_fill(~attention_mask, pad_id)
    batch = TensorDict({
        "input_ids": input_ids, "attention_mask": attention_mask, "reply_mask": attention_mask[:, width_p:],
        "prompt_length": prompt_len, "reply_length": reply_len,
        "advantage": torch.randn(n, generator=gen), "reward": torch.zeros(n),
        "reply_stopped": reply_len < args.max_new_tokens}, batch_size=[n])
    return batch, prompt_len, reply_len


# kernel name fragments -> kind, first match wins: where a train pass's GPU time goes
KERNEL_KINDS = (("flash", "attention"), ("fmha", "attention"), ("attention", "attention"), ("gemm", "matmul"),
                ("cutlass", "matmul"), ("nvjet", "matmul"), ("sm90", "matmul"), ("sm100", "matmul"),
                ("adam", "optimizer"), ("triton", "fused (compiled)"), ("nccl", "communication"),
                ("memcpy", "copies"), ("memset", "copies"), ("reduce", "reductions"))


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for fragment, kind in KERNEL_KINDS if fragment in low), "other elementwise")


def print_kernel_profile(call) -> None:
    """One ``call`` under torch.profiler: its 25 heaviest GPU kernels, their time summed by kind, and the share of
    the call's wall time some kernel ran (the rest the GPU waited for the host)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_kind: dict[str, float] = {}
    for e in kernels:
        by_kind[kernel_kind(e.name)] = by_kind.get(kernel_kind(e.name), 0.0) + e.time_range.elapsed_us() / 1e6
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:  # the union of the kernels' intervals (us): overlapping streams count once
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90), flush=True)
    print(json.dumps({"profiled_wall_s": round(wall, 3), "gpu_busy_share": round(busy / 1e6 / wall, 3),
                      "kernels": len(kernels),
                      "gpu_s_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])}}),
          flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from hydra import compose, initialize_config_dir

    from bench_vs_trl import build_random_init_model
    from grpo.training.logprobs import ReplyLogProbs, score_replies
    from grpo.training.models import (enable_activation_checkpointing, load_policy_model, load_tokenizer,
                                      mixed_precision_dtype)
    from grpo.training.settings import ModelSettings, OptimizerSettings
    from grpo.training.step import GRPOSettings, GRPOStep
    from grpo.training.trainer import make_optimizer, make_scheduler

    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if args.logit_chunk_mib:
        import grpo.training.logprobs

        grpo.training.logprobs.GPU_LOGIT_CHUNK_BYTES = args.logit_chunk_mib * 2**20
    variants = [parse_variant(v) for v in args.variants.split(";")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_init_model(args.shape, str(REPO / args.tokenizer), Path(tmp) / args.shape, args.seed)
        with initialize_config_dir(str(REPO / "config"), version_base=None):
            cfg = compose("grpo_gsm8k", [f"model.name={model_dir}", f"inference_model.max_new_tokens={args.max_new_tokens}",
                                         f"train.dialog_turns_per_batch={args.replies}"])
        tokenizer = load_tokenizer(str(model_dir))
        print(json.dumps({"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                          "shape": args.shape, "replies": args.replies, "optim_batch_size": cfg.train.optim_batch_size}))
        # each variant sets which of its layers recompute
        model = load_policy_model(ModelSettings.from_config(cfg), tokenizer, device)
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        params = sum(p.numel() for p in initial.values()) - initial["model.embed_tokens.weight"].numel()
        base = GRPOSettings.from_config(cfg)
        optim = dataclasses.replace(OptimizerSettings.from_config(cfg), total_optim_steps=10)
        # autocast as the trainer's (grpo.training.trainer): without it a GPU trains the float32 weights in float32
        policy = ReplyLogProbs(model, base.temperature,
                               autocast_dtype=mixed_precision_dtype(cfg.train_model.mixed_precision, model))
        if base.compile:  # once: every variant's step then shares the compiled layers and head
            policy.compile_for_training()
        for spread in args.lengths.split(","):
            batch, prompt_len, reply_len = synthetic_batch(len(tokenizer), args, spread, tokenizer.pad_token_id)
            batch["behaviour_log_probs"] = score_replies(batch, policy, base).float()  # on-policy
            tokens = int((prompt_len + reply_len).sum())
            objectives = []
            for variant in variants:
                enable_activation_checkpointing(model, variant["ckpt"])
                settings = dataclasses.replace(base, gradient_checkpointing=variant["ckpt"] > 0, compile=False,
                                               micro_batch_size=variant["rows"], micro_batch_tokens=variant["tokens"],
                                               packed_sequences=variant["packed"])
                policy.packed = variant["packed"]

                def fresh_step() -> GRPOStep:
                    """The variant's step from the initial weights, with a new optimiser."""
                    with torch.no_grad():
                        model.load_state_dict(initial)
                    optimizer = make_optimizer(optim, model)
                    return GRPOStep(settings, policy=policy, optimizer=optimizer,
                                    scheduler=make_scheduler(optim, optimizer), pad_token_id=tokenizer.pad_token_id)

                times, first = [], None
                for call in range(1 + args.repeats):
                    step = fresh_step()
                    torch.manual_seed(args.seed)  # the same minibatches for every variant
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                    t0 = time.perf_counter()
                    metrics = step.optimize(batch.clone())
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    if call:
                        times.append(time.perf_counter() - t0)
                        first = metrics["loss_objective"] if first is None else first
                    del step
                objectives.append(first)
                if args.profile and device.type == "cuda":
                    step = fresh_step()
                    print_kernel_profile(lambda: step.optimize(batch.clone()))
                    del step
                best = min(times)
                print(json.dumps({
                    "lengths": spread, "mean_reply": round(float(reply_len.float().mean()), 1), "ckpt": variant["ckpt"],
                    "rows": variant["rows"], "tokens_cap": variant["tokens"], "packed": variant["packed"],
                    "micro_batches": metrics["micro_batches"],
                    "train_s": round(best, 3), "tokens": tokens, "model_tflop_s": round(6 * params * tokens / best / 1e12, 2),
                    "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if device.type == "cuda" else None,
                    "objective": first}))
            spread_rel = (max(objectives) - min(objectives)) / max(1e-12, max(abs(o) for o in objectives))
            print(json.dumps({"lengths": spread, "objective_relative_spread": spread_rel}))


if __name__ == "__main__":
    main()
