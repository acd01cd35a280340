#!/usr/bin/env python
"""What a rollout batch costs to hand from a rollout worker to the trainer, in one invocation (CPU).

    python benchmarks/bench_batch_transfer.py                        # 128 replies x 512 tokens
    python benchmarks/bench_batch_transfer.py --replies 64 --max-new-tokens 64 --no-ray

A real TorchRL collector over the tiny model (``config/grpo_tiny``) generates ``--replies`` replies of
exactly ``--max-new-tokens`` tokens each (no stop token ends them early), as a rollout worker does. Two
forms a worker can return are timed: the collector's tensordict (what workers returned before issue 28)
and ``grpo.training.replies.Replies`` (what they return now; ``convert_s``: ``Replies.from_collector`` on the
worker). For each: ``pickle.dumps`` (the worker's side), ``pickle.loads`` (the trainer's) and the bytes
between them, unless ``--no-ray`` ``ray.put`` / ``ray.get`` through a local Ray object store (what a Ray
actor's return goes through). Best of ``--repeats`` each; ratios are before / after. ``dense_s``: the
trainer's first use of ``Replies`` (the dense training batch and the step's rollout metrics).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replies", type=int, default=128, help="replies in the batch (env.num_envs)")
    p.add_argument("--group", type=int, default=8, help="replies per prompt (env.repeats)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="every reply's length")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the best is printed")
    p.add_argument("--no-ray", action="store_true", help="skip ray.put / ray.get")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def never_stopping_rollouts(replies: int, group: int, max_new_tokens: int, seed: int, device: str = "cpu"):
    """The tiny model's training env and a sampling policy over it (the model on ``device``) whose replies all run
    to ``max_new_tokens`` (no stop token ends them early): ``(env, policy, sampler, tokenizer, model)``."""
    import torch
    from tensordict import set_list_to_stack

    from grpo.inference.decoding import ReplySampler
    from grpo.inference.engine import make_transformers_policy
    from grpo.inference.generation import EngineSettings, generate_kwargs
    from grpo.tasks.paths import resolve_local_paths
    from grpo.tasks.envs import make_env
    from grpo.tasks.settings import TaskSettings
    from grpo.training.models import load_policy_model, load_tokenizer
    from grpo.training.settings import ModelSettings
    from tools.compose import compose_config

    set_list_to_stack(True).set()
    torch.manual_seed(seed)
    cfg = compose_config("grpo_tiny", [f"env.num_envs={replies}", f"env.repeats={group}",
                                       f"inference_model.max_new_tokens={max_new_tokens}"])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    model = load_policy_model(ModelSettings.from_config(cfg), tok, torch.device(device))
    sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
    never = [tok.vocab_size + 1000]  # a stop id no token has
    policy = make_transformers_policy(sampler, tok, gen_kwargs=generate_kwargs(
        EngineSettings.from_config(cfg), tok, greedy=False, max_new_tokens=max_new_tokens, stop_ids=never))
    env = make_env(TaskSettings.from_config(cfg), tok, split=cfg.env.train_split, repeats=group, num_envs=replies)
    return env, policy, sampler, tok, model


def collect(args):
    """One collector batch, reshaped as the rollout sources hand it on; the tiny model's stop ids and pad id."""
    from grpo.tasks.envs import make_collector
    from grpo.training.models import stop_token_ids

    env, policy, _, tok, model = never_stopping_rollouts(args.replies, args.group, args.max_new_tokens, args.seed)
    t0 = time.perf_counter()
    batch = next(iter(make_collector(env, policy, args.replies))).reshape(-1)
    print(f"collected {batch.numel()} replies in {time.perf_counter() - t0:.1f} s", flush=True)
    return batch, stop_token_ids(tok, model.generation_config), tok.pad_token_id


def best_of(repeats: int, fn):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def measure(name: str, obj, args, ray_mod) -> dict:
    dump_s, data = best_of(args.repeats, lambda: pickle.dumps(obj))
    load_s, _ = best_of(args.repeats, lambda: pickle.loads(data))
    row = {"form": name, "bytes": len(data), "dumps_s": dump_s, "loads_s": load_s}
    if ray_mod is not None:
        put_s, ref = best_of(args.repeats, lambda: ray_mod.put(obj))
        get_s, _ = best_of(args.repeats, lambda: ray_mod.get(ref))
        row |= {"ray_put_s": put_s, "ray_get_s": get_s}
    print(json.dumps(row), flush=True)
    return row


def main(argv=None):
    args = parse_args(argv)
    from grpo.training.batch import rollout_metrics, to_training_batch
    from grpo.training.replies import Replies

    batch, stop_ids, pad_token_id = collect(args)
    ray_mod = None
    if not args.no_ray:
        import ray

        ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
        ray_mod = ray
    convert_s, replies = best_of(args.repeats, lambda: Replies.from_collector(batch))
    dense_s, _ = best_of(args.repeats, lambda: rollout_metrics(replies, to_training_batch(replies, pad_token_id)))
    print(json.dumps({"convert_s": convert_s, "dense_s": dense_s}), flush=True)
    before, after = measure("collector tensordict", batch, args, ray_mod), measure("Replies", replies, args, ray_mod)
    ratios = {k: before[k] / after[k] for k in after if k != "form" and after[k] > 0}
    print("before / after: " + ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items()))
    print(f"worker to trainer, pickled: before {before['dumps_s'] + before['loads_s']:.4f} s (dumps + loads), after "
          f"{convert_s + after['dumps_s'] + after['loads_s']:.4f} s (convert + dumps + loads)")
    if ray_mod is not None:
        ray_mod.shutdown()


if __name__ == "__main__":
    main()
