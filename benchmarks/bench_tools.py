"""Episodes with the Python tool against single-turn replies: step time, sampled tokens a second, and where the
time goes (the engine sampling, the sandbox's calls, which the engine waits on, the train part).

Runs grpo/grpo.py once per config, one after the other, in alternating order when repeated, and prints per run:
seconds a step, the model's sampled tokens a step and a second of generation, the tool's calls a step, the seconds a
step waits on the tool (``generation_env_s``: the engine idle meanwhile) and its share of generation. Equal sampled
tokens is the fair unit: an episode holds the tool's tokens too, which are context, not samples.

    python benchmarks/bench_tools.py                                  # grpo_tiny against grpo_tools_tiny, CPU
    python benchmarks/bench_tools.py --configs grpo_qwen05b,grpo_qwen05b_tools --repeats 1 -- train.total_steps=5
    python benchmarks/bench_tools.py --configs grpo_tools_tiny,grpo_tools_tiny+inference_model.continuous_turns=false

A config may carry overrides of its own after a ``+`` each (``NAME+key=value+key=value``).

Time with OMP_NUM_THREADS=1 and nothing else running; ratios hold within one invocation only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="grpo_tiny,grpo_tools_tiny", help="comma list of config names")
    p.add_argument("--repeats", type=int, default=2, help="runs of each config, in alternating order")
    p.add_argument("--steps", type=int, default=6, help="GRPO steps a run")
    p.add_argument("--warmup", type=int, default=1, help="first steps of a run left out (compiling, warm-up)")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (after --)")
    return p.parse_args(argv)


def run_once(spec: str, steps: int, warmup: int, overrides: list[str], run_dir: Path) -> dict:
    config, *own = spec.split("+")
    cmd = [sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-name", config, f"hydra.run.dir={run_dir}",
           f"train.total_steps={steps}", "eval.frequency=0", "eval.num_problems=1", "logging.progress_bar=false",
           "logging.export=false", "logging.samples_every=0", *overrides, *own]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if "reward" in r and "step_time_s" in r][warmup:]
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in steps_rows)  # noqa: E731
    sampled = mean("sampled_tokens")
    return {"step_s": mean("step_time_s"), "generation_s": mean("generation_s"), "env_s": mean("generation_env_s"),
            "engine_s": mean("generation_engine_s"),
            "train_s": mean("train_s"), "sampled_tokens": sampled, "calls": mean("tools/calls_per_episode"),
            "turns": mean("episode/turns"), "sampled_tokens_per_generation_s": sampled / mean("generation_s")}


def main(argv=None) -> None:
    args = parse_args(argv)
    configs = args.configs.split(",")
    results = {config: [] for config in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for config in configs if repeat % 2 == 0 else reversed(configs):  # alternating: no order effect
                results[config].append(run_once(config, args.steps, args.warmup, args.overrides,
                                                Path(tmp) / f"run-{len(results[config])}-{configs.index(config)}"))
    w = max(len(c) for c in configs)
    print(f"{'config':<{w}} {'step s':>7} {'gen s':>7} {'engine s':>8} {'tool wait s':>11} {'wait share':>10} "
          f"{'train s':>7} {'turns':>5} {'calls/ep':>8} {'sampled tok/gen s':>17}")
    for config, runs in results.items():
        avg = {key: statistics.mean(r[key] for r in runs) for key in runs[0]}
        print(f"{config:<{w}} {avg['step_s']:7.2f} {avg['generation_s']:7.2f} {avg['engine_s']:8.2f} {avg['env_s']:11.2f} "
              f"{avg['env_s'] / avg['generation_s']:10.1%} {avg['train_s']:7.2f} {avg['turns']:5.2f} "
              f"{avg['calls']:8.2f} {avg['sampled_tokens_per_generation_s']:17.1f}")
    if len(configs) == 2:
        a, b = (statistics.mean(r["sampled_tokens_per_generation_s"] for r in results[c]) for c in configs)
        print(f"sampled tokens a second of generation, {configs[1]} / {configs[0]}: {b / a:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
