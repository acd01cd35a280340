#!/usr/bin/env python
"""Rollout generation on one GPU: transformers' ``generate`` against our decode loop (grpo.inference.decoding).

    python benchmarks/bench_generation.py --shapes qwen2.5-0.5b,qwen2.5-1.5b --batches 64,128 --max-new-tokens 512
    python benchmarks/bench_generation.py --device cpu --shapes tiny-wide-vocab --batches 8 --max-new-tokens 16   # smoke test

For each random-init model shape (bench_vs_trl's) and batch size, the same left-padded GSM8K chat
prompts (``--prompts-per-batch`` questions x the rest as repeats, as a rollout batch) are sampled
with the rollout settings (temperature 1, top_k/top_p off) by:

* ``hf``: ``model.generate`` as TorchRL's wrapper calls it (``output_logits``: full logits per token);
* ``ours``: ``grpo.inference.decoding.ReplySampler`` (compiled decode step, KV cache sized to the batch;
  on a GPU, decode attention reads each reply's filled cache slots only and tokens are drawn by Triton kernels);
* ``compact``: the same with ``compact_rows`` (rows whose reply ended leave the batch, which halves).

The variants that settled the retired switches (``dense``: attention over every cache slot; ``inductor_sampler``:
the compiled sampler on a GPU) went with them; their measurements are in benchmarks/README.md.

A random-init model never stops on its own: every reply runs to ``--max-new-tokens``. ``--mean-reply N``
makes replies end as real ones do, at spread lengths: about one token in N (``vocab / N`` random token ids)
stops a reply, since a random-init model's next-token distribution is close to uniform.

After one warm-up call (which pays compilation), ``--calls`` timed calls give generated tokens/s
(tokens up to each reply's end), the decode bound (batch x memory bandwidth / bytes of weights:
every decode step must read all weights once), the percentage of it reached, and the peak GPU
memory over the timed calls, next to weights + KV cache. The bandwidth is measured here (a large
device-to-device copy), not taken from a data sheet. Our sampler's log-probs are compared with a
teacher-forced forward of the same weights (mean |difference| per token).

On a GPU a one-kernel CUDA graph is captured before any variant: a decode step's dependent launches pay only in the
first CUDA graph a process captures (``warm_graph_state``), and a job captures several (eval's greedy step, each
compacted batch), so every variant is measured as a job runs, whatever its place in ``--variants``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b", help="comma list of bench_vs_trl random-init shapes")
    p.add_argument("--tokenizer", default="assets/tiny-model", help="tokenizer folder for the random-init models")
    p.add_argument("--data", default="data/gsm8k_tiny/train.jsonl", help="GSM8K-format questions")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--batches", default="64,128", help="comma list of replies per generate call")
    p.add_argument("--prompts-per-batch", type=int, default=16, help="distinct questions per batch (rest: repeats)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="reply length cap")
    p.add_argument("--calls", type=int, default=2, help="timed calls per variant, after one warm-up call")
    p.add_argument("--variants", default="hf,ours", help="comma list of: hf, ours, compact")
    p.add_argument("--mean-reply", type=int, default=0, help="replies end after about this many tokens (0: never)")
    p.add_argument("--compile-prefill", type=int, default=1, help="ours: the prefill compiled too, as a long run would "
                   "(inference_model.compile_prefill; 0: eager, the job's default)")
    p.add_argument("--cache-bucket", type=int, default=128, help="ours: KV cache length rounding (inference_model.cache_bucket)")
    p.add_argument("--profile", action="store_true", help="ours: print the GPU kernels of one more call (torch.profiler)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def copy_bandwidth(device) -> float:
    """Bytes per second of a 2 GiB device-to-device copy (it reads and writes every byte)."""
    import torch

    src = torch.empty(2**29, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 10 * 2 * src.numel() * 4 / (time.perf_counter() - t0)


def warm_graph_state(device) -> None:
    """Capture (and drop) a one-kernel CUDA graph, so that no variant's decode step is the process's first graph.

    One H200, 0.5B x 128 (2026-11-28): the same replayed decode step took 1,138 us while it was the process's first
    captured graph and 1,247 us after any other capture (a one-kernel graph, on another stream, never replayed, then
    deleted), for good; with dependent launches off, 1,237 us either way. A job captures more than one (eval's greedy
    step, each compacted batch), so the first variant of an invocation read ~9% faster than a job's decoding."""
    import torch

    x = torch.zeros(8, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    del graph


def chat_prompts(tok, data: str, questions: int, batch: int):
    """``batch`` left-padded prompts: ``questions`` GSM8K questions, each repeated as a GRPO group."""
    import torch
    from torchrl.envs.llm import GSM8KEnv

    rows = [json.loads(line) for line in open(REPO / data)][:questions]
    chats = [[{"role": "system", "content": GSM8KEnv.SYSTEM_PROMPT}, {"role": "user", "content": r["question"]}]
             for r in rows]
    chats = [chats[i * len(chats) // batch] for i in range(batch)]
    enc = tok.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt", padding=True,
                                  padding_side="left", return_dict=True)
    return enc["input_ids"], enc["attention_mask"].to(torch.long)


def reply_tokens(sequences, prompt_len: int, stop_ids, pad_id) -> int:
    """Generated tokens up to and including each reply's first stop token."""
    import torch

    replies = sequences[:, prompt_len:]
    ended = torch.isin(replies, torch.tensor(stop_ids, device=replies.device))
    before_end = (ended.long().cumsum(1) - ended.long()) == 0
    return int(before_end.sum())


def log_prob_gap(model, out, input_ids, attention_mask, pad_id) -> float:
    """Mean |sampler log-prob - teacher-forced log-prob| over the reply tokens of 8 replies."""
    import torch

    seq, prompt_len = out["sequences"][:8], input_ids.shape[1]
    mask = torch.cat([attention_mask[:8], (seq[:, prompt_len:] != pad_id).long()], 1)
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits
    lp = logits[:, prompt_len - 1:-1].float().log_softmax(-1).gather(-1, seq[:, prompt_len:, None])[..., 0]
    valid = mask[:, prompt_len:].bool()
    return float((lp - out["log_probs"][:8]).abs()[valid].mean())


def print_kernel_profile(call) -> None:
    """The GPU kernels of one call, heaviest first: where a decode step's time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70), flush=True)


def run_shape(args, shape: str, bandwidth: float | None) -> list[dict]:
    import torch
    from bench_vs_trl import build_random_init_model

    from grpo.inference.decoding import ReplySampler
    from grpo.training.models import load_causal_lm, load_tokenizer, stop_token_ids

    device = torch.device(args.device)
    model_dir = build_random_init_model(shape, str(REPO / args.tokenizer), Path(tempfile.mkdtemp()) / shape, seed=0)
    tok = load_tokenizer(str(model_dir))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_causal_lm(str(model_dir), tok, dtype=dtype, device=device).eval().requires_grad_(False)
    stop_ids = stop_token_ids(tok, model.generation_config)
    if args.mean_reply:
        vocab = model.config.get_text_config().vocab_size
        drawn = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:vocab // args.mean_reply]
        stop_ids = sorted(set(stop_ids) | set(drawn.tolist()))
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    text = model.config.get_text_config()
    kv_bytes_per_token = (2 * text.num_hidden_layers * text.num_key_value_heads
                          * (text.hidden_size // text.num_attention_heads) * torch.finfo(dtype).bits // 8)
    options = dict(max_new_tokens=args.max_new_tokens, eos_token_id=stop_ids, pad_token_id=tok.pad_token_id,
                   do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        input_ids, attention_mask = (t.to(device) for t in chat_prompts(tok, args.data, args.prompts_per_batch, batch))
        for variant in args.variants.split(","):
            if variant == "hf":
                model.set_attn_implementation("sdpa")  # transformers' own path, as before this project's loop
                call = lambda: model.generate(input_ids=input_ids, attention_mask=attention_mask,  # noqa: E731
                                              output_logits=True, return_dict_in_generate=True, **options)
            else:
                sampler = ReplySampler(model, compile=True, compile_prefill=bool(args.compile_prefill),
                                       cache_bucket=args.cache_bucket,
                                       compact_rows=variant == "compact")
                call = lambda: sampler.generate(input_ids, attention_mask, **options)  # noqa: E731
            sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            t0 = time.perf_counter()
            out = call()
            sync()
            warmup_s = time.perf_counter() - t0
            del out
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            seconds, tokens = 0.0, 0
            for _ in range(args.calls):
                out = None  # hf's full logits for 128 x 512 tokens are 40 GB: never hold two calls' at once
                t0 = time.perf_counter()
                out = call()
                sync()
                seconds += time.perf_counter() - t0
                tokens += reply_tokens(out["sequences"], input_ids.shape[1], stop_ids, tok.pad_token_id)
            row = {"shape": shape, "batch": batch, "variant": variant, "prompt_len": input_ids.shape[1],
                   "warmup_call_s": round(warmup_s, 2), "call_s": round(seconds / args.calls, 3),
                   "tokens_per_s": round(tokens / seconds, 1), "weights_gb": round(weight_bytes / 1e9, 3)}
            if bandwidth:  # before the log-prob check below, whose full-vocabulary forward is not generation
                row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
            if variant != "hf":
                row["decode_batches"] = sampler.batch_sizes  # of the last call
                row["kv_cache_gb"] = round(sampler.kv_cache(batch, 1)[0] * batch * kv_bytes_per_token / 1e9, 3)
                row["log_prob_gap"] = log_prob_gap(model, out, input_ids, attention_mask, tok.pad_token_id)
            if args.profile and variant != "hf" and device.type == "cuda":
                print_kernel_profile(call)
            if bandwidth:
                row["bound_tokens_per_s"] = round(batch * bandwidth / weight_bytes)
                row["pct_of_bound"] = round(100 * row["tokens_per_s"] / row["bound_tokens_per_s"], 1)
            del out
            rows.append(row)
            print(json.dumps(row), flush=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


VARIANTS = ("hf", "ours", "compact")


def main(argv=None) -> None:
    args = parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; use {', '.join(VARIANTS)}")
    import torch

    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    if device.type == "cuda":
        warm_graph_state(device)
    header = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "copy_bandwidth_tb_s": round(bandwidth / 1e12, 2) if bandwidth else None,
              "max_new_tokens": args.max_new_tokens, "mean_reply": args.mean_reply, "calls": args.calls,
              "compile_prefill": bool(args.compile_prefill)}
    print(json.dumps(header), flush=True)
    rows = [row for shape in args.shapes.split(",") for row in run_shape(args, shape, bandwidth)]
    print(f"\n{'shape':<14}{'batch':>6} {'variant':<17}{'tokens/s':>10}{'% bound':>9}{'peak GB':>9}"
          f"{'weights+KV':>11}{'call s':>8}{'warm-up s':>10}")
    for r in rows:
        fixed = r["weights_gb"] + r.get("kv_cache_gb", 0)
        print(f"{r['shape']:<14}{r['batch']:>6} {r['variant']:<17}{r['tokens_per_s']:>10.0f}"
              f"{r.get('pct_of_bound', float('nan')):>9.1f}{r.get('peak_gb', float('nan')):>9.2f}{fixed:>11.2f}"
              f"{r['call_s']:>8.2f}{r['warmup_call_s']:>10.1f}")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        for batch in dict.fromkeys(r["batch"] for r in rows):
            pair = {r["variant"]: r for r in rows if r["shape"] == shape and r["batch"] == batch}
            for variant, base in (("ours", "hf"), ("compact", "ours")):
                if {variant, base} <= set(pair):
                    print(f"{shape} batch {batch}: {variant}/{base} tokens/s = "
                          f"{pair[variant]['tokens_per_s'] / pair[base]['tokens_per_s']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({**header, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
