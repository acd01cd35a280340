"""Print what a run's metrics.jsonl says: eval rows, the per-step time split, peak GPU memory and
the diagnostics that show sampler and trainer agree.

    python benchmarks/summarize_run.py outputs/2026-11-23/12-00-00 [--skip-first 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SPLIT = ("step_time_s", "generation_s", "generation_engine_s", "reference_s", "train_s", "weight_sync_s")
WATCH = ("reward", "success_rate", "kl_to_ref", "mismatch/kl", "clip_fraction", "grad_norm",
         "response_length", "response_length_max", "response_truncated_fraction", "gpu_peak_memory_gb",
         "graphs_compiled")


def summarize(run_dir: Path, skip_first: int) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_time_s" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    timed = steps[skip_first:] or steps
    out = {
        "steps": len(steps),
        "split_mean_s": {k: statistics.mean(r[k] for r in timed if k in r) for k in SPLIT if any(k in r for r in timed)},
        "evals": [{k: v for k, v in r.items() if k == "step" or k.startswith("eval/")} for r in evals],
        "per_step": [{k: r[k] for k in ("step", *WATCH) if k in r} for r in steps],
    }
    peaks = [r["gpu_peak_memory_gb"] for r in steps if "gpu_peak_memory_gb" in r]
    if peaks:
        out["gpu_peak_memory_gb_max"] = max(peaks)
    kl = [r["kl_to_ref"] for r in steps if "kl_to_ref" in r]
    if kl:
        out["kl_to_ref_max"] = max(kl)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--skip-first", type=int, default=1, help="steps left out of the mean split (compile, warm-up)")
    args = p.parse_args()
    summary = summarize(args.run_dir, args.skip_first)
    print(json.dumps({k: v for k, v in summary.items() if k != "per_step"}, indent=1))
    for row in summary["per_step"]:
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
