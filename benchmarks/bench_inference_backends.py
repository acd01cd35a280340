#!/usr/bin/env python
"""Our engine against vLLM, each built as the job builds it, on the same prompts in one invocation.

    python benchmarks/bench_inference_backends.py --shapes qwen2.5-0.5b,qwen2.5-1.5b --replies 128 --max-new-tokens 512
    python benchmarks/bench_inference_backends.py --device cpu --shapes tiny-wide-vocab --replies 8 --max-new-tokens 16

For each random-init model shape (bench_vs_trl's, bfloat16 files on a GPU) and each backend, a fresh process
composes the GPU default config (``grpo_gsm8k``) with ``model.name`` the random-init model and
``inference_model.backend`` the backend, builds the engine with ``grpo.inference.engine.make_inference`` from a
float32 "trainer" model (as the job's master weights) and samples ``--replies`` replies of exactly
``--max-new-tokens`` tokens (no stop token: every backend decodes the same number of steps) to GSM8K chat prompts,
``--prompts`` questions each repeated as a GRPO group, through the engine's ``sample``, the call a rollout makes.

The trainer's tied embedding is scaled by ``--logit-scale`` before the engine starts: a random-init model's
next-token distribution is close to uniform (every log-prob about -log(vocab) whatever the weights), scaled it is
peaked, so the sampler-trainer log-prob gap below fails loudly if a weight push missed.

Per shape and backend: engine start (construction: load, weight push, vLLM's graph capture) and first call
(compilation) seconds, generated tokens/s over ``--calls`` timed calls, the decode bound (replies x measured memory
bandwidth / bytes of bfloat16 weights: every decode step reads all weights once) and the share of it reached, peak
GPU memory (torch's allocator, vLLM's KV cache included: it lives in this process) and the device's used memory, the
seconds of a weight push from the trainer, and the mean and largest |engine log-prob - trainer log-prob| over the
tokens of 8 replies (the trainer scores the replies teacher-forced in float32). A process a backend keeps the
numbers apart: two vLLM engines in one process do not give back the first's GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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
    p.add_argument("--backends", default="transformers,vllm", help="comma list of inference_model.backend values")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--replies", type=int, default=128, help="replies per sample call (a rollout batch)")
    p.add_argument("--prompts", type=int, default=16, help="distinct questions per call (the rest: repeats)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="tokens each reply decodes")
    p.add_argument("--calls", type=int, default=3, help="timed calls, after one warm-up call")
    p.add_argument("--pushes", type=int, default=3, help="timed weight pushes from the trainer")
    p.add_argument("--logit-scale", type=float, default=10.0, help="the trainer's tied embedding times this")
    p.add_argument("--tokenizer", default="assets/tiny-model", help="tokenizer folder for the random-init models")
    p.add_argument("--data", default="data/gsm8k_tiny/train.jsonl", help="GSM8K-format questions")
    p.add_argument("--override", action="append", default=[], help="extra config override for every engine")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--one", nargs=2, metavar=("MODEL_DIR", "BACKEND"), help=argparse.SUPPRESS)  # a child process
    return p.parse_args(argv)


def gpu_used_gb(torch) -> float:
    free, total = torch.cuda.mem_get_info()
    return round((total - free) / 1e9, 2)


def teacher_forced_gap(trainer, prompts, replies) -> tuple[float, float]:
    """Mean and largest |engine log-prob - trainer log-prob| over the tokens of the replies."""
    import torch

    gaps = []
    with torch.no_grad():
        for prompt, (tokens, log_probs) in zip(prompts, replies):
            ids = torch.cat([prompt, tokens])[None].to(trainer.device)
            logits = trainer(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            trainer_lp = logits.log_softmax(-1).gather(-1, tokens.to(ids.device)[:, None])[:, 0].cpu()
            gaps.append((trainer_lp - log_probs.float()).abs())
    gap = torch.cat(gaps)
    return float(gap.mean()), float(gap.max())


def run_one(args, model_dir: str, backend: str) -> dict:
    """One backend on one model, in this process."""
    import torch
    from bench_generation import chat_prompts, copy_bandwidth

    from grpo.inference.engine import make_inference
    from grpo.inference.generation import EngineSettings
    from grpo.training.models import load_causal_lm, load_tokenizer
    from tools.compose import compose_config

    device = torch.device(args.device)
    is_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    cfg = compose_config("grpo_gsm8k", [f"model.name={model_dir}", f"inference_model.backend={backend}",
                                        f"inference_model.max_new_tokens={args.max_new_tokens}", *args.override])
    settings = EngineSettings.from_config(cfg)
    tok = load_tokenizer(model_dir)
    trainer = load_causal_lm(model_dir, tok, dtype=torch.float32, device=device).eval().requires_grad_(False)
    trainer.get_input_embeddings().weight.mul_(args.logit_scale)
    input_ids, attention_mask = chat_prompts(tok, args.data, args.prompts, args.replies)
    prompts = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]
    bandwidth = copy_bandwidth(device) if is_cuda else None

    start = time.perf_counter()
    engine = make_inference(settings, trainer, tok, device=device, stop_ids=[])
    if backend == "vllm":  # stop_ids=[] leaves vLLM's own stop at the model's eos: every reply full length instead
        for params in engine.sampling_params.values():
            params.ignore_eos = True
    sync()
    start_s = time.perf_counter() - start

    def call():
        replies = engine.policy.sample(prompts, args.max_new_tokens, batch_rows=len(prompts))
        sync()
        return replies

    start = time.perf_counter()
    call()
    first_call_s = time.perf_counter() - start
    if is_cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds, tokens = [], 0
    for _ in range(args.calls):
        start = time.perf_counter()
        replies = call()
        seconds.append(time.perf_counter() - start)
        tokens += sum(len(reply) for reply, _ in replies)
    row = {"backend": backend, "engine_start_s": round(start_s, 1), "first_call_s": round(first_call_s, 1),
           "call_s": round(statistics.median(seconds), 3),
           "tokens_per_s": round(tokens / sum(seconds)), "reply_tokens": tokens // (args.calls * len(prompts))}
    if is_cuda:
        row["peak_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        row["device_used_gb"] = gpu_used_gb(torch)
        weight_bytes = sum(p.numel() * 2 for p in trainer.parameters())  # bfloat16, a tied matrix once
        row["bound_tokens_per_s"] = round(len(prompts) * bandwidth / weight_bytes)
        row["pct_of_bound"] = round(100 * row["tokens_per_s"] / row["bound_tokens_per_s"], 1)
    pushes = [engine.push_weights(trainer, version=i + 1) for i in range(args.pushes)]
    sync()
    row["push_s"] = round(statistics.median(pushes), 3)
    row["log_prob_gap_mean"], row["log_prob_gap_max"] = (round(x, 4) for x in teacher_forced_gap(
        trainer, prompts[:8], call()[:8]))
    engine.shutdown()
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(run_one(args, *args.one)), flush=True)
        return
    from bench_vs_trl import build_random_init_model

    header = {"device": args.device, "replies": args.replies, "max_new_tokens": args.max_new_tokens,
              "calls": args.calls, "logit_scale": args.logit_scale, "overrides": args.override}
    if args.device == "cuda":
        import torch

        header["device"] = torch.cuda.get_device_name()
    print(json.dumps(header), flush=True)
    rows = []
    child_args = list(argv if argv is not None else sys.argv[1:])
    for shape in args.shapes.split(","):
        model_dir = build_random_init_model(shape, str(REPO / args.tokenizer), Path(tempfile.mkdtemp()) / shape, seed=0)
        for backend in args.backends.split(","):
            out = subprocess.run([sys.executable, __file__, *child_args, "--one", str(model_dir), backend],
                                 cwd=REPO, env=os.environ, stdout=subprocess.PIPE, text=True)
            found = [line[4:] for line in out.stdout.splitlines() if line.startswith("ROW ")]
            if out.returncode or not found:
                print(out.stdout[-3000:], flush=True)
                raise SystemExit(f"{shape} with {backend}: the child process failed (rc {out.returncode})")
            row = {"shape": shape, **json.loads(found[0])}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'shape':<16}{'backend':<13}{'tokens/s':>9}{'% bound':>8}{'call s':>8}{'start s':>8}{'1st call':>9}"
          f"{'peak GB':>8}{'used GB':>8}{'push s':>8}{'|lp gap|':>9}{'max':>7}")
    for r in rows:
        print(f"{r['shape']:<16}{r['backend']:<13}{r['tokens_per_s']:>9}{r.get('pct_of_bound', float('nan')):>8.1f}"
              f"{r['call_s']:>8.2f}{r['engine_start_s']:>8.1f}{r['first_call_s']:>9.1f}"
              f"{r.get('peak_allocated_gb', float('nan')):>8.2f}{r.get('device_used_gb', float('nan')):>8.2f}"
              f"{r['push_s']:>8.3f}{r['log_prob_gap_mean']:>9.4f}{r['log_prob_gap_max']:>7.3f}")
    backends = args.backends.split(",")
    for shape in dict.fromkeys(r["shape"] for r in rows):
        by = {r["backend"]: r for r in rows if r["shape"] == shape}
        for other in backends[1:]:
            if {backends[0], other} <= set(by):
                print(f"{shape}: {other}/{backends[0]} tokens/s = "
                      f"{by[other]['tokens_per_s'] / by[backends[0]]['tokens_per_s']:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({**header, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
