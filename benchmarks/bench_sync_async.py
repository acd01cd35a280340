"""Sync vs async GRPO throughput on the same model, batch and devices.

Runs grpo/grpo.py and grpo/grpo-async.py one after the other with the same overrides and prints
samples/s (replies trained per second of wall time, after warm-up steps), the time split and the
async/sync ratio. On a 2-GPU machine: training on GPU 0, generation on GPU 1.

    python benchmarks/bench_sync_async.py --steps 12                                # tiny model, CPU
    python benchmarks/bench_sync_async.py --random-init-shape qwen2.5-0.5b --steps 10 \\
        -- train_model.devices=[0] inference_model.devices=[1] allow_cpu=false
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


def run(script: str, config_name: str, run_dir: Path, overrides: list[str]) -> dict:
    cmd = [sys.executable, str(REPO / "grpo" / script), "--config-name", config_name, f"hydra.run.dir={run_dir}",
           *overrides]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{script} failed:\n{proc.stderr[-4000:]}")
    alloc = [line for line in proc.stdout.splitlines() if line.startswith(("Device allocation", "  "))]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"rows": [r for r in rows if "reward" in r], "wall_s": wall, "allocation": "\n".join(alloc)}


def summarize(result: dict, warmup: int, replies_per_step: int) -> dict:
    rows = result["rows"][warmup:]
    # wall time between logged steps: for async this includes overlap, for sync the full sequence
    step_s = sum(r["step_time_s"] for r in rows) / len(rows)
    tokens = sum(r["response_length"] for r in rows) / len(rows) * replies_per_step
    out = {"samples_per_s": replies_per_step / step_s, "tokens_per_s": tokens / step_s, "step_s": step_s,
           "dropped_stale_batches": result["rows"][-1].get("dropped_stale_batches", 0),
           "weight_pushes_verified": result["rows"][-1].get("weight_pushes_verified", 0),
           "weight_pushes_mismatched": result["rows"][-1].get("weight_pushes_mismatched", 0)}
    for key in ("generation_s", "reference_s", "train_s", "weight_sync_s", "trainer_wait_s", "policy_lag_mean",
                "policy_lag_max", "collector_weight_apply_s", "gpu_peak_memory_gb"):
        vals = [r[key] for r in rows if key in r]
        if vals:
            out[key] = sum(vals) / len(vals)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the averages")
    p.add_argument("--random-init-shape", default=None, help="e.g. qwen2.5-0.5b (GPU speed runs)")
    p.add_argument("--config-name", default="grpo_tiny", help="the config both scripts run (grpo_gsm8k: the default job)")
    p.add_argument("--out", default=None, help="write the summary as JSON here")
    p.add_argument("overrides", nargs="*", help="Hydra overrides passed to both scripts")
    args = p.parse_args()
    overrides = [f"train.total_steps={args.steps}", "eval.frequency=0", "eval.num_problems=32", "logger=none",
                 "logging.progress_bar=false", *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.random_init_shape:
            from bench_vs_trl import build_random_init_model

            model_dir = build_random_init_model(args.random_init_shape, str(REPO / "assets" / "tiny-model"),
                                                tmp / "model", seed=0)
            overrides.append(f"model.name={model_dir}")
        from omegaconf import OmegaConf

        layers = [REPO / "config" / "grpo_gsm8k.yaml"] + ([REPO / "config" / f"{args.config_name}.yaml"]
                                                          if args.config_name != "grpo_gsm8k" else [])
        replies = OmegaConf.merge(*map(OmegaConf.load, layers),
                                  OmegaConf.from_dotlist([o for o in overrides if o.startswith("train.")]))
        replies_per_step = replies.train.dialog_turns_per_batch
        results = {}
        for mode, script in (("sync", "grpo.py"), ("async", "grpo-async.py")):
            raw = run(script, args.config_name, tmp / mode, overrides)
            results[mode] = summarize(raw, args.warmup, replies_per_step) | {"wall_s": raw["wall_s"]}
            print(f"== {mode}\n{raw['allocation']}")
            print("   " + "  ".join(f"{k}={v:.3f}" for k, v in results[mode].items()))
    ratio = results["async"]["samples_per_s"] / results["sync"]["samples_per_s"]
    print(f"async/sync samples/s ratio: {ratio:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(results | {"ratio": ratio}, indent=2))


if __name__ == "__main__":
    main()
