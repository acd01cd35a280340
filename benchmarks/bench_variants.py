"""GRPO loss variants and DAPO's additions over seeds: held-out accuracy and throughput.

Runs grpo/grpo.py once per (config, variant, seed), one run at a time, and prints per config and
variant the held-out accuracy at the start, at the end and at its best eval (mean ± standard
deviation over seeds, and the worst seed's end - start gain), and trained replies per second of
step time.

    python benchmarks/bench_variants.py                                        # both tiny tasks, all variants
    python benchmarks/bench_variants.py --configs grpo_tiny --variants grpo --seeds 0,1,2
    python benchmarks/bench_variants.py --configs grpo_ifeval_tiny -- train.total_steps=30   # extra overrides

Time each run with OMP_NUM_THREADS=1 and nothing else running: samples/s compares variants within
one invocation only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {  # every switch explicit: a config's own defaults (grpo_ifeval_tiny samples dynamically) do not leak in
    "grpo": ["train.loss_variant=grpo", "train.dynamic_sampling=false", "train.overlong_filter=false"],
    "dr_grpo": ["train.loss_variant=dr_grpo", "train.dynamic_sampling=false", "train.overlong_filter=false"],
    "gspo": ["train.loss_variant=gspo", "train.dynamic_sampling=false", "train.overlong_filter=false"],
    "dapo": ["train.loss_variant=grpo", "train.dynamic_sampling=true", "train.overlong_filter=true"],
}
# the eval key a config reports its task's score under
SCORES = {"grpo_tiny": "eval/accuracy", "grpo_ifeval_tiny": "eval/prompt_strict_acc"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="grpo_tiny,grpo_ifeval_tiny", help="comma list of config names")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of: {', '.join(VARIANTS)}")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds")
    p.add_argument("--out", default=None, help="write every run's numbers as JSON here")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run (after --)")
    return p.parse_args(argv)


def run_once(config: str, overrides: list[str], run_dir: Path) -> dict:
    cmd = [sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-name", config, f"hydra.run.dir={run_dir}",
           "logging.progress_bar=false", "logging.export=false", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    score = SCORES[config]
    evals = [r[score] for r in rows if score in r]
    steps = [r for r in rows if "reward" in r]
    replies = OmegaConf.load(run_dir / ".hydra" / "config.yaml").train.dialog_turns_per_batch
    return {"start": evals[0], "end": evals[-1], "best": max(evals), "evals": evals,
            "samples_per_s": replies * len(steps) / sum(r["step_time_s"] for r in steps),
            "extra_generation_batches": sum(r.get("extra_generation_batches", 0) for r in steps)}


def mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.3f} ± {sd:.3f}"


def main(argv=None) -> None:
    args = parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in args.configs.split(","):
            for variant in args.variants.split(","):
                for seed in seeds:
                    run_dir = Path(tmp) / f"{config}-{variant}-{seed}"
                    out = run_once(config, [f"seed={seed}", *VARIANTS[variant], *args.overrides], run_dir)
                    results.append({"config": config, "variant": variant, "seed": seed, **out})
                    print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"\n{'config':18} {'variant':10} {'start':>14} {'end':>14} {'best':>14} {'worst gain':>10} "
          f"{'samples/s':>9} {'extra batches':>13}")
    for config in args.configs.split(","):
        for variant in args.variants.split(","):
            rs = [r for r in results if r["config"] == config and r["variant"] == variant]
            print(f"{config:18} {variant:10} {mean_sd([r['start'] for r in rs]):>14} "
                  f"{mean_sd([r['end'] for r in rs]):>14} {mean_sd([r['best'] for r in rs]):>14} "
                  f"{min(r['end'] - r['start'] for r in rs):>+10.3f} "
                  f"{statistics.mean(r['samples_per_s'] for r in rs):>9.1f} "
                  f"{statistics.mean(r['extra_generation_batches'] for r in rs):>13.1f}")


if __name__ == "__main__":
    main()
