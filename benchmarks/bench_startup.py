"""Start-up time and peak memory against the data's size: the shipped tiny data (2,000 train rows) and a
100,000-row copy of it (its rows repeated), each run eval only on 16 problems, under ``/usr/bin/time -v``.

    python benchmarks/bench_startup.py                 # 100,000 rows
    python benchmarks/bench_startup.py --rows 20000    # another size

Each size runs once to warm the datasets cache and the page cache, then ``--repeats`` times; the fastest
wall time and the largest peak RSS are kept. Start-up here is the whole eval-only run: its eval of 16
problems is the same for both sizes, so what differs is the data's loading and checking.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY_DATA = REPO / "data" / "gsm8k_tiny"


def write_rows(folder: Path, rows: int) -> Path:
    """``folder`` with ``rows`` train rows (the shipped ones over and over) and the shipped test split."""
    folder.mkdir(parents=True)
    shipped = (TINY_DATA / "train.jsonl").read_text().splitlines()
    (folder / "train.jsonl").write_text("\n".join(itertools.islice(itertools.cycle(shipped), rows)) + "\n")
    (folder / "test.jsonl").write_text((TINY_DATA / "test.jsonl").read_text())
    return folder


def run_once(data: Path, run_dir: Path) -> tuple[float, float]:
    """Wall seconds and peak RSS (GB) of one eval-only run on ``data``."""
    command = ["/usr/bin/time", "-v", sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-name", "grpo_tiny",
               "train.total_steps=0", "eval.num_problems=16", "eval.batch_size=16", "logging.progress_bar=false",
               f"env.dataset={data}", f"hydra.run.dir={run_dir}"]
    env = os.environ | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"the run on {data} failed:\n{proc.stderr[-3000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", proc.stderr)
    hours, minutes, seconds = (float(g) if g else 0.0 for g in wall.groups())
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    return hours * 3600 + minutes * 60 + seconds, rss_kb / 1e6


def measure(data: Path, scratch: Path, repeats: int) -> tuple[float, float]:
    runs = [run_once(data, scratch / f"run{i}") for i in range(repeats + 1)][1:]  # the first warms the caches
    return min(wall for wall, _ in runs), max(rss for _, rss in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="train rows of the large copy")
    parser.add_argument("--repeats", type=int, default=2, help="measured runs per size, after one warm-up run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        large = write_rows(scratch / f"rows_{args.rows}", args.rows)
        shipped_wall, shipped_rss = measure(TINY_DATA, scratch / "shipped", args.repeats)
        large_wall, large_rss = measure(large, scratch / "large", args.repeats)
    print(f"{'train rows':>12} {'start-up s':>11} {'peak RSS GB':>12}")
    shipped_rows = len((TINY_DATA / "train.jsonl").read_text().splitlines())
    print(f"{shipped_rows:>12,} {shipped_wall:>11.1f} {shipped_rss:>12.2f}")
    print(f"{args.rows:>12,} {large_wall:>11.1f} {large_rss:>12.2f}")
    print(f"{'ratio':>12} {large_wall / shipped_wall:>11.2f} {large_rss / shipped_rss:>12.2f}")


if __name__ == "__main__":
    main()
