#!/usr/bin/env python
"""What a rollout collection costs outside the sampler: TorchRL's ``LLMCollector`` loop and ``TransformersWrapper``
policy against ours (``grpo.tasks.envs.OneTurnCollector``, ``grpo.inference.episode_policy.EpisodePolicy``), in one
invocation (CPU, one thread; or the model on a GPU).

    OMP_NUM_THREADS=1 python benchmarks/bench_collection.py                  # 128 replies x 256 tokens
    OMP_NUM_THREADS=1 python benchmarks/bench_collection.py --replies 64 --max-new-tokens 64
    python benchmarks/bench_collection.py --device cuda --max-new-tokens 300

The tiny model (``config/grpo_tiny``) generates ``--replies`` replies of exactly ``--max-new-tokens`` tokens
(no stop token ends them early) through the training env (GSM8K chat prompts and reward). Each round
collects one batch with each of three (TorchRL's collector and wrapper; ours with TorchRL's wrapper, as until
2026-11-27; ours with our policy), alternating the order; per collection it prints the wall and process CPU
seconds, the seconds inside the sampler (``ReplySampler.generate``) and the rest: the env's reset and step (chat
history, reward), the collector's loop and the policy around the sampler. The medians over the rounds are
compared: ``rest`` is what a GPU host pays on its CPU every step, whatever the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replies", type=int, default=128, help="replies in a batch (env.num_envs)")
    p.add_argument("--group", type=int, default=8, help="replies per prompt (env.repeats)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="every reply's length")
    p.add_argument("--rounds", type=int, default=5, help="rounds of one collection each; the medians are compared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where the tiny model runs: cpu or cuda")
    return p.parse_args(argv)


def build(args):
    """The env, the policy over a ``ReplySampler`` whose time is counted, and that counter."""
    from bench_batch_transfer import never_stopping_rollouts

    env, policy, sampler, _, _ = never_stopping_rollouts(args.replies, args.group, args.max_new_tokens, args.seed,
                                                         args.device)
    sampler_s = [0.0]
    generate = sampler.generate

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return generate(*a, **kw)
        finally:
            sampler_s[0] += time.perf_counter() - t0

    sampler.generate = timed_generate  # the policy calls it through the sampler object
    return env, policy, sampler, sampler_s


def collectors(env, policy, sampler, replies: int) -> dict:
    """TorchRL's collector and policy wrapper, set up as the engine set them up, then ours: collector first, then
    policy too (``grpo.inference.episode_policy.EpisodePolicy``; its one-turn form since 2026-11-27)."""
    import warnings

    from torchrl.collectors.llm import LLMCollector

    from grpo.tasks.envs import make_collector
    from torchrl_wrapper import torchrl_history_policy

    wrapper = torchrl_history_policy(sampler, policy.tokenizer, policy.generate_kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchRL's InitTracker notice, as make_collector silences it
        torchrl = LLMCollector(env, policy=wrapper, dialog_turns_per_batch=replies, total_dialog_turns=-1)
    torchrl.return_same_td = True
    return {"torchrl LLMCollector + TransformersWrapper": iter(torchrl),
            "OneTurnCollector + TransformersWrapper": iter(make_collector(env, wrapper, replies)),
            "OneTurnCollector + EpisodePolicy": iter(make_collector(env, policy, replies))}


def main(argv=None):
    args = parse_args(argv)
    env, policy, sampler, sampler_s = build(args)
    batches = collectors(env, policy, sampler, args.replies)
    names = list(batches)
    for name in names:  # a first collection each: the sampler's first call and the env's lazy setup
        next(batches[name])
    rows = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else names[::-1]:
            sampler_s[0] = 0.0
            wall, cpu = time.perf_counter(), time.process_time()
            batch = next(batches[name])
            row = {"collector": name, "replies": batch.numel(), "wall_s": time.perf_counter() - wall,
                   "cpu_s": time.process_time() - cpu, "sampler_s": sampler_s[0]}
            row["rest_s"] = row["wall_s"] - row["sampler_s"]
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            rows[name].append(row)
    medians = {name: {key: statistics.median(r[key] for r in rows[name]) for key in ("rest_s", "wall_s", "cpu_s")}
               for name in names}
    ours = medians[names[-1]]
    for name in names[:-1]:
        before = medians[name]
        print(f"medians of {args.rounds}, {name} -> {names[-1]}: outside the sampler {before['rest_s']:.3f} s "
              f"-> {ours['rest_s']:.3f} s ({before['rest_s'] / ours['rest_s']:.2f}x); whole collection "
              f"{before['wall_s']:.3f} s -> {ours['wall_s']:.3f} s (CPU {before['cpu_s']:.3f} s -> "
              f"{ours['cpu_s']:.3f} s)")


if __name__ == "__main__":
    main()
