#!/usr/bin/env python
"""Episodes of several turns sampled by turns against continuously (``inference_model.continuous_turns``), in one
invocation: the rollout policy of a config with a turn environment (the code interpreter by default) samples the same
batches of real prompts each way, in alternating order, after one warm-up batch each (compiling).

    python benchmarks/bench_turns.py --device cuda                                   # real Qwen 0.5B, 256 episodes
    OMP_NUM_THREADS=1 python benchmarks/bench_turns.py --config grpo_tools_tiny --model assets/tiny-tools-model \
        --data data/tools_tiny --episodes 64

Per batch and way it prints the wall seconds, the engine's (``generate_s``), the wait on the tool (``env_seconds``),
turns and tool calls an episode, sampled tokens and their rate, decode steps, and where the continuous way spends
its checks: the host's seconds ending turns (``end_turns``) and joining turns to the batch (``join``: the prefill of
their contexts; and its parts: ``extend_rows`` and its ``extend_forward``, ``into_rows`` and its
``place_cache_rows``), each timed with the GPU drained first. ``--join-every`` lists values of
``turn_streaming.JOIN_EVERY_CHECKS`` to compare, each one more way; ``--whole-joins`` adds each of them with every
joining turn's whole context prefilled in a free row (as before the rows were kept for their episodes' next turns).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tools.compose import compose_config  # noqa: E402
from grpo.inference import prefill, turn_streaming  # noqa: E402
from grpo.inference.decoding import ReplySampler  # noqa: E402
from grpo.inference.engine import TransformersInference  # noqa: E402
from grpo.inference.episodes import EpisodeBatch  # noqa: E402
from grpo.inference.generation import EngineSettings  # noqa: E402
from grpo.tasks.envs import make_env  # noqa: E402
from grpo.tasks.paths import resolve_local_paths  # noqa: E402
from grpo.tasks.settings import TaskSettings  # noqa: E402
from grpo.tasks.tool_env import make_turn_env, turn_stop_ids  # noqa: E402
from grpo.training.models import load_tokenizer, stop_token_ids  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="grpo_qwen05b_code", help="a config with a turn environment")
    p.add_argument("--model", default="assets/qwen2.5-coder-0.5b-instruct")
    p.add_argument("--data", default="data/gsm8k_real")
    p.add_argument("--episodes", type=int, default=256, help="episodes a batch (env.num_envs)")
    p.add_argument("--batches", type=int, default=3, help="timed batches a way, after one warm-up batch")
    p.add_argument("--join-every", default="1,4", help="comma list of JOIN_EVERY_CHECKS values, one way each")
    p.add_argument("--whole-joins", action="store_true", help="also each continuous way with whole-context joins")
    p.add_argument("--device", default="cpu")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides (after --)")
    return p.parse_args(argv)


class Timers:
    """Seconds and calls of the streaming loop's host steps, the GPU drained before and after each."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.calls = device, {}, {}
        self.steps = 0

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def wrap(self, module, name: str):
        inner = getattr(module, name)

        def timed(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.sync()
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                self.calls[name] = self.calls.get(name, 0) + 1

        setattr(module, name, timed)

    def count_steps(self):
        build = ReplySampler.decode_step_for

        def counted(sampler, *args, **kwargs):
            buf, step = build(sampler, *args, **kwargs)

            def replay():
                self.steps += 1
                step()

            return buf, replay

        ReplySampler.decode_step_for = counted

    def take(self) -> dict:
        out = {"decode_steps": self.steps, **{f"{k}_s": v for k, v in self.seconds.items()},
               **{f"{k}_calls": v for k, v in self.calls.items()}}
        self.seconds, self.calls, self.steps = {}, {}, 0
        return out


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    cfg = compose_config(args.config, [f"model.name={args.model}", f"env.dataset={args.data}",
                                       f"env.num_envs={args.episodes}", *(["allow_cpu=true"] if device.type == "cpu"
                                                                          else []), *args.overrides])
    resolve_local_paths(cfg)
    task, settings = TaskSettings.from_config(cfg), EngineSettings.from_config(cfg)
    tok = load_tokenizer(cfg.model.name)
    from transformers import GenerationConfig

    stops = turn_stop_ids(task, tok, stop_token_ids(tok, GenerationConfig.from_pretrained(cfg.model.name)))
    engine = TransformersInference(settings, None, tok, device, stops)
    engine.turn_env = make_turn_env(task, tok)
    env = make_env(task, tok, split=task.train_split, repeats=cfg.env.repeats, num_envs=args.episodes)
    policy, continuous = engine.policy, engine.policy.sample_episodes
    timers = Timers(device)
    timers.wrap(turn_streaming, "join")
    timers.wrap(turn_streaming, "end_turns")
    timers.wrap(turn_streaming, "decode_batch")
    # a join's parts: kept rows (extend_rows: the KV moves around extend_forward, the added tokens' forward) or free
    # rows (into_rows: the whole contexts' prefill, then place_cache_rows writes them into the batch's cache)
    for name in ("extend_rows", "into_rows"):
        timers.wrap(prefill.Prefill, name)
    for name in ("extend_forward", "place_cache_rows"):
        timers.wrap(prefill, name)
    timers.count_steps()
    ways = ["by_turns"] + [f"continuous_join{j}{whole}" for j in args.join_every.split(",")
                           for whole in ("", "_whole")[:1 + args.whole_joins]]
    end_turn = EpisodeBatch.end_turn
    results = {way: [] for way in ways}
    for batch in range(args.batches + 1):
        reset = env.reset()
        for way in ways if batch % 2 == 0 else reversed(ways):
            policy.sample_episodes = None if way == "by_turns" else continuous
            if way != "by_turns":
                turn_streaming.JOIN_EVERY_CHECKS = int(way.removeprefix("continuous_join").removesuffix("_whole"))
            # no row held for an episode's next turn: it joins in a free row, its whole context prefilled
            EpisodeBatch.end_turn = (lambda *a: end_turn(*a) and False) if way.endswith("_whole") else end_turn
            torch.manual_seed(batch)
            timers.take()
            engine_s, env_s, start = engine.generate_s, policy.env_seconds, time.perf_counter()
            out = policy(reset.copy())
            wall = time.perf_counter() - start
            sampled = int(sum(int(m.sum()) for m in out.get(("episode", "sampled_mask"), as_list=True)))
            row = {"wall_s": wall, "engine_s": engine.generate_s - engine_s, "env_wait_s": policy.env_seconds - env_s,
                   "turns": float(out["episode", "turns"].float().mean()),
                   "tool_calls": float(out["episode", "tool_calls"].float().mean()), "sampled_tokens": sampled,
                   "sampled_tok_s": sampled / wall, **timers.take()}
            print(f"batch {batch} {way}: " + " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                                      for k, v in row.items()), flush=True)
            if batch:  # the first compiles
                results[way].append(row)
    print("\nmedians over", args.batches, "batches:")
    for way, rows in results.items():
        keys = sorted({k for r in rows for k in r})
        print(f"{way:<20} " + " ".join(f"{k}={statistics.median(r.get(k, 0) for r in rows):.3g}" for k in keys))
    base = statistics.median(r["wall_s"] for r in results["by_turns"])
    for way in ways[1:]:
        print(f"by_turns / {way} wall: {base / statistics.median(r['wall_s'] for r in results[way]):.2f}x")


if __name__ == "__main__":
    main()
