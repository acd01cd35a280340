#!/usr/bin/env python
"""Rollout generation with transformers: eager decoding vs the compiled static-cache decode step.

    python benchmarks/bench_generation.py --device cuda --random-init-shape qwen2.5-0.5b --max-new-tokens 64

Each variant collects ``--calls`` rollout batches of P prompts x G replies through the project's
own path (``GSM8KTaskEnv`` + ``grpo.envs.make_collector`` + ``make_transformers_policy``), with the
rollout config's sampling settings; the variants differ only in the ``generate`` options of
``grpo.models.compiled_decode_kwargs``. Every batch has different prompts (so different prompt
widths). It prints, per variant, the first call (which pays any compile) and the mean of the others:
seconds per batch, generated tokens/s, and the time inside ``model.generate`` alone (the rest is
TorchRL's history-mode round trip: chat template, tokenising, unpadding, log-probs), and how far
the sampler's log-probs are from an eager teacher-forced forward of the same weights, also after
an in-place update of the weights (what the optimiser does between rollouts).
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
    p.add_argument("--model", default="assets/tiny-model", help="local model folder")
    p.add_argument("--random-init-shape", default=None, help="a random-init shape of bench_vs_trl (e.g. qwen2.5-0.5b)")
    p.add_argument("--data", default="data/gsm8k_tiny", help="GSM8K-format data folder")
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument("--dtype", default="bfloat16", help="model dtype on GPU")
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--repeats", type=int, default=8, help="replies per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help="reply length cap")
    p.add_argument("--calls", type=int, default=6, help="batches per variant (the first pays warm-up)")
    p.add_argument("--variants", default="eager,static512,static_grow",
                   help="comma list of: eager, static<N> (static cache of N positions, compiled), static_grow "
                        "(static cache sized by transformers per call, compiled)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def decode_options(variant: str) -> dict:
    if variant == "eager":
        return {}
    if variant == "static_grow":
        return {"cache_implementation": "static"}
    if variant.startswith("static"):
        return {"cache_implementation": "static", "max_cache_len": int(variant[len("static"):])}
    raise SystemExit(f"unknown variant {variant!r}")


def sampler_trainer_gap(model, rollouts, tokenizer, stop_ids) -> float:
    """Mean |sampler's log-prob - an eager teacher-forced forward's| per reply token: the
    ``trainer_sampler_log_ratio_abs`` the training step logs with truncated IS on."""
    from grpo.batch import to_training_batch
    from grpo.step import score_replies

    batch = to_training_batch(rollouts, tokenizer.pad_token_id, stop_ids)
    gap = (score_replies(batch, model, rollouts.numel()) - batch["behaviour_log_probs"]) * batch["reply_mask"]
    return float(gap.abs().sum() / batch["reply_mask"].sum().clamp_min(1))


def main(argv=None) -> None:
    args = parse_args(argv)
    import torch
    from tensordict import set_list_to_stack

    from grpo.envs import make_collector, make_env
    from grpo.generation import generate_kwargs
    from grpo.inference import make_transformers_policy
    from grpo.models import configure_attention_kernels, load_causal_lm, load_tokenizer, stop_token_ids
    from grpo.setup import resolve_local_paths
    from tools.compose import compose_config

    set_list_to_stack(True).set()
    model_dir = args.model
    if args.random_init_shape:
        from bench_vs_trl import build_random_init_model

        model_dir = str(build_random_init_model(args.random_init_shape, str(REPO / args.model),
                                                Path(tempfile.mkdtemp()) / "model", seed=0))
    batch = args.prompts * args.repeats
    cfg = compose_config("grpo_tiny", [f"model.name={model_dir}", f"env.dataset={args.data}",
                                       f"env.repeats={args.repeats}", f"env.num_envs={batch}",
                                       f"inference_model.max_new_tokens={args.max_new_tokens}"])
    resolve_local_paths(cfg)
    configure_attention_kernels(cfg)
    device = torch.device(args.device)
    tok = load_tokenizer(cfg.model.name)
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    model = load_causal_lm(cfg.model.name, tok, dtype=dtype, device=device).eval()
    stop_ids = stop_token_ids(tok, model.generation_config)

    inside = []
    original_generate = model.generate

    def timed_generate(*a, **kw):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = original_generate(*a, **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        inside.append(time.perf_counter() - t0)
        return out

    model.generate = timed_generate
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "batch": batch,
               "max_new_tokens": args.max_new_tokens, "variants": {}}
    for variant in args.variants.split(","):
        torch.manual_seed(0)
        env = make_env(cfg, tok, split="train", repeats=args.repeats, num_envs=batch)
        policy = make_transformers_policy(model, tok, gen_kwargs={
            **generate_kwargs(cfg, tok, greedy=False, max_new_tokens=args.max_new_tokens, stop_ids=stop_ids),
            **decode_options(variant)})
        collector = make_collector(env, policy, batch)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        inside.clear()
        walls, tokens = [], []
        iterator = iter(collector)
        for _ in range(args.calls):
            t0 = time.perf_counter()
            rollouts = next(iterator).reshape(-1)
            walls.append(time.perf_counter() - t0)
            tokens.append(sum(int(r["tokens", "response"].shape[-1]) for r in rollouts.unbind(0)))
        # the sampler's log-probs against an eager teacher-forced forward of the same weights: the
        # compiled decode step must sample from the model the trainer scores
        gap = sampler_trainer_gap(model, rollouts, tok, stop_ids)
        # the optimiser updates weights in place; a compiled decode step must see the new values
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.1 * param.float().std().to(param.dtype))
        gap_after_update = sampler_trainer_gap(model, next(iterator).reshape(-1), tok, stop_ids)
        rest = slice(1, None) if args.calls > 1 else slice(None)
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        row = {
            "first_call_s": walls[0], "first_generate_s": inside[0],
            "batch_s": mean(walls[rest]), "generate_s": mean(inside[rest]),
            "tokens_per_s": sum(tokens[rest]) / sum(walls[rest]),
            "per_call_s": [round(w, 3) for w in walls], "tokens_per_call": tokens,
            "logprob_gap_mean_abs": gap, "logprob_gap_after_update": gap_after_update,
            "peak_cuda_gb": torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None,
        }
        results["variants"][variant] = row
        print(f"{variant:>12}: first {row['first_call_s']:.2f} s, then {row['batch_s']:.3f} s/batch "
              f"(generate {row['generate_s']:.3f} s), {row['tokens_per_s']:.0f} tokens/s; calls {row['per_call_s']}; "
              f"|sampler - trainer| log-prob {row['logprob_gap_mean_abs']:.4f}, "
              f"after an in-place weight update {row['logprob_gap_after_update']:.4f}",
              flush=True)
    base = results["variants"].get("eager")
    if base:
        for name, row in results["variants"].items():
            if name != "eager":
                print(f"{name}: {base['batch_s'] / row['batch_s']:.2f}x eager per batch")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
