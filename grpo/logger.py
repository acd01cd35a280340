"""Run outputs: ``metrics.jsonl`` (one JSON object per logged step), wandb, and plots.

Each row is written and flushed as soon as it is logged, so a killed run keeps every
row up to its last step. wandb runs offline when no API key is configured;
``logger=none`` turns it off.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

PLOTTED = ["reward", "eval/accuracy", "kl_to_ref", "loss_objective", "clip_fraction", "ess", "entropy",
           "response_length", "grad_norm"]


class RunLogger:
    def __init__(self, run_dir: Path, cfg, resolved_config: dict, *, wandb_run_id: str | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = open(self.path, "a", buffering=1)
        self.wandb = None
        if cfg.logger == "wandb":
            self.wandb = _start_wandb(cfg, self.run_dir, resolved_config, wandb_run_id)

    @property
    def wandb_run_id(self) -> str | None:
        return self.wandb.id if self.wandb is not None else None

    def log(self, row: dict) -> None:
        row = {k: (float(v) if hasattr(v, "item") else v) for k, v in row.items()}
        self._file.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))

    def close(self, exit_code: int = 0) -> None:
        self._file.close()
        if self.wandb is not None:
            self.wandb.finish(exit_code=exit_code)
            self.wandb = None
        plot_metrics(self.path, self.run_dir / "metrics.png")


def _start_wandb(cfg, run_dir: Path, resolved_config: dict, run_id: str | None):
    import wandb

    mode = cfg.wandb.mode
    if mode == "auto":
        mode = "online" if (os.environ.get("WANDB_API_KEY") or _has_netrc_key()) else "offline"
    return wandb.init(
        project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.logging.experiment_name,
        dir=str(run_dir), config=resolved_config, mode=mode, id=run_id, resume="allow" if run_id else None,
        settings=wandb.Settings(console="off", x_disable_stats=True),
    )


def _has_netrc_key() -> bool:
    netrc = Path.home() / ".netrc"
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")


@contextlib.contextmanager
def profile_to(run_dir: Path, step: int):
    """Records what runs inside with ``torch.profiler``, then writes ``profile_step<N>.txt`` (ops by
    self time, device time first on a GPU) and ``profile_step<N>.json.gz`` (a Chrome/Perfetto trace)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        yield
    stem = Path(run_dir) / f"profile_step{step}"
    sort_by = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    stem.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=sort_by, row_limit=60, max_name_column_width=70))
    prof.export_chrome_trace(f"{stem}.json.gz")  # torch gzips a path ending in .gz


def read_metrics(path: Path) -> list[dict]:
    """Every row; a torn last line (the run was killed while writing it) is dropped."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:  # only the last line can be torn; anything else is a damaged file
                raise
    return rows


def plot_metrics(metrics_path: Path, out_png: Path) -> None:
    """One panel per metric against the step; eval rows as markers."""
    try:
        import matplotlib
    except ImportError:  # a bare GPU image may lack it; the metrics file is what matters
        warnings.warn("matplotlib is not installed: no metrics.png (pip install matplotlib)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    names = [n for n in PLOTTED if any(n in r for r in rows)]
    if not names:
        return
    cols = 3
    fig, axes = plt.subplots((len(names) + cols - 1) // cols, cols, figsize=(12, 3 * ((len(names) + cols - 1) // cols)),
                             squeeze=False)
    for ax, name in zip(axes.flat, names):
        pts = [(r["step"], r[name]) for r in rows if name in r and r[name] is not None]
        ax.plot(*zip(*pts), marker="o" if name.startswith("eval/") else None, markersize=4)
        ax.set_title(name)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
