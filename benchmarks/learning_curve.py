"""The learning curve of GRPO runs: held-out strict and flexible accuracy and reply length against
training wall-clock (the sum of the steps' step_time_s: generation, reference, training and weight
push, without eval or checkpoint time), as JSON and a PNG.

    python benchmarks/learning_curve.py RUN_DIR [RUN_DIR ...] --out benchmarks/real_learning
    python benchmarks/learning_curve.py RUN_DIR ... "benchmarks/real_learning_shared.json:1.5B seed 0" --out ...

A source is a run dir, or a curves JSON written earlier (``FILE.json``: all its runs; ``FILE.json:LABEL``: that
one), so a plot can put new runs beside an earlier session's whose run dirs are gone. Each run dir is labelled by
its config name and seed (``--labels`` overrides, one per run dir). The JSON also holds, per
run, the accuracy at the eval nearest to each ``--marks`` minute (10 and 20 by default), the largest
``kl_to_ref`` and the mean step time. Where the runs logged them, accuracies carry their standard error
(error bars) and each eval its gain since the first with the paired standard error (same problems).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.loop.logger import read_metrics  # noqa: E402


def curve(run_dir: Path) -> dict:
    rows = read_metrics(run_dir / "metrics.jsonl")
    minutes, elapsed = {0: 0.0}, 0.0  # step -> training minutes when it ended
    for row in rows:
        if "step_time_s" in row:
            elapsed += row["step_time_s"]
            minutes[row["step"]] = elapsed / 60
    evals = [{"step": r["step"], "train_minutes": round(minutes.get(r["step"], elapsed / 60), 2),
              **{k.removeprefix("eval/"): r[k] for k in ("eval/accuracy", "eval/accuracy_stderr", "eval/gain",
                                                           "eval/gain_stderr", "eval/strict_accuracy",
                                                           "eval/flexible_accuracy", "eval/answer_rate",
                                                           "eval/response_length", "eval/truncated_fraction",
                                                           "eval/tool_calls_per_episode", "eval/tool_error_rate")
                 if k in r}}
             for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "step_time_s" in r]
    return {"run": run_dir.name, "evals": evals, "steps": len(steps),
            "step_time_s_mean": statistics.mean(r["step_time_s"] for r in steps) if steps else None,
            "kl_to_ref_max": max((r["kl_to_ref"] for r in steps if "kl_to_ref" in r), default=None)}


def at_minute(evals: list[dict], minute: float) -> dict | None:
    """The last eval at or before ``minute`` of training."""
    before = [e for e in evals if e["train_minutes"] <= minute + 1e-9]
    return before[-1] if before else None


def gain_text(e: dict) -> str:
    """``, +9.0 ± 2.1 points``: the eval's gain since the run's first, with its paired standard error, where logged."""
    return f", {100 * e['gain']:+.1f} ± {100 * e['gain_stderr']:.1f} points" if "gain" in e else ""


def label_of(run_dir: Path) -> str:
    config = run_dir / ".hydra" / "config.yaml"
    if not config.exists():
        return run_dir.name
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(config)
    return f"{Path(cfg.model.name).name} seed {cfg.seed}"


def earlier_curves(source: str) -> dict[str, dict]:
    """The runs of a curves JSON written earlier: ``FILE.json`` (all of them) or ``FILE.json:LABEL`` (one)."""
    stem, picked, label = source.partition(".json:")
    path = Path(stem + ".json" if picked else source)
    curves = json.loads(path.read_text())
    if not picked:
        return curves
    if label not in curves:
        sys.exit(f"learning_curve: {path} has no run {label!r}; it has {sorted(curves)}")
    return {label: curves[label]}


def is_curves_json(source: str) -> bool:
    return source.endswith(".json") or ".json:" in source


def plot(curves: dict[str, dict], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, length) = plt.subplots(1, 2, figsize=(12, 4))
    handles, strict = [], False  # a run's entry, in run order (matplotlib lists error-bar entries after lines)
    for i, (label, c) in enumerate(curves.items()):
        color = f"C{i}"
        t = [e["train_minutes"] for e in c["evals"]]
        stderr = [e.get("accuracy_stderr") for e in c["evals"]]  # eval/accuracy's: the default (flexible) extraction
        handles.append(acc.errorbar(t, [e.get("flexible_accuracy", e["accuracy"]) for e in c["evals"]], fmt="o-",
                                    color=color, yerr=None if None in stderr else stderr, capsize=2,
                                    label=label))
        if all("strict_accuracy" in e for e in c["evals"]):
            acc.plot(t, [e["strict_accuracy"] for e in c["evals"]], "s--", color=color, alpha=0.6)
            strict = True
        length.plot(t, [e["response_length"] for e in c["evals"]], "o-", color=color, label=label)
    acc.set(title="held-out greedy accuracy", xlabel="training minutes", ylabel="accuracy")
    length.set(title="held-out mean reply length", xlabel="training minutes", ylabel="tokens")
    if strict:  # one legend entry for the style, not one a run
        handles += acc.plot([], [], "s--", color="gray", alpha=0.6, label="strict extraction (dashed)")
    acc.legend(handles=handles, fontsize=7)
    length.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png, dpi=90)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run dirs, or FILE.json[:LABEL] curves written earlier")
    ap.add_argument("--labels", nargs="*", help="one per run dir (default: model folder and seed)")
    ap.add_argument("--marks", nargs="*", type=float, default=[10, 20], help="training minutes to report at")
    ap.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.png")
    args = ap.parse_args()
    run_dirs = [Path(r) for r in args.runs if not is_curves_json(r)]
    labels = iter(args.labels or [label_of(r) for r in run_dirs])
    curves = {}
    for source in args.runs:
        curves.update(earlier_curves(source) if is_curves_json(source) else {next(labels): curve(Path(source))})
    for c in curves.values():
        c["at_minutes"] = {str(m): at_minute(c["evals"], m) for m in args.marks}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(curves, indent=1) + "\n")
    plot(curves, args.out.with_suffix(".png"))
    for label, c in curves.items():
        first, *_ = c["evals"] or [None]
        marks = " ".join(f"{m}min: {e['flexible_accuracy' if 'flexible_accuracy' in e else 'accuracy']:.3f} "
                         f"(step {e['step']}{gain_text(e)})" if e else f"{m}min: -" for m, e in c["at_minutes"].items())
        print(f"{label}: step 0 {first['accuracy']:.3f} | {marks} | kl_to_ref max {c['kl_to_ref_max']:.3f} | "
              f"step {c['step_time_s_mean']:.1f} s" if first else f"{label}: no eval")


if __name__ == "__main__":
    main()
