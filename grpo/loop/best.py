"""The run's best held-out checkpoint and its health at each eval.

``logging.keep_best``: the weights of the step with the best held-out accuracy so far are kept in
``<run dir>/best/``, apart from ``logging.keep_last``'s pruning, and named in the summary. A run whose
policy collapsed (lr=1.0 with ``train.on_nonfinite=skip``, or lr=0.05: held-out accuracy 0.438 -> 0.000) ended
"run finished", its collapsed policy exported and every good checkpoint pruned. Now each eval far below the
best, or after ``SKIPPED_IN_A_ROW`` steps whose every optimiser step was skipped as non-finite, is a warning line
naming the best checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from grpo.process.console import say

COLLAPSE_RATIO = 0.5      # an eval below half the best accuracy...
COLLAPSE_MARGIN = 0.1     # ...and at least 10 points below it (a small eval's noise near 0 is no collapse)
SKIPPED_IN_A_ROW = 3      # steps in a row that changed no weight: the gradients keep coming out non-finite


class BestCheckpoint:
    """``keep``: ``logging.keep_best``; ``rows``: the run dir's metrics rows so far (a resumed run's best and skips
    count)."""

    def __init__(self, keep: bool, run_dir: Path, rows: list[dict]):
        self.keep, self.folder = keep, run_dir / "best"
        evals = [(row["step"], row["eval/accuracy"]) for row in rows if "eval/accuracy" in row]
        self.best: tuple[int, float] | None = max(evals, key=lambda e: e[1]) if evals else None
        self.path: Path | None = next(iter(sorted(self.folder.glob("step_*.json"))), None) if self.keep else None
        self.kept = self.best if self.path else None  # (step, accuracy) of the weights at ``path``
        self.skipped_in_a_row = 0
        for row in rows:
            self.count_skips(row)

    def count_skips(self, row: dict) -> None:
        """A step's row: did it skip every optimiser step (``train.on_nonfinite=skip``)?"""
        if "skipped_optim_steps" in row:  # optim_steps: those taken
            all_skipped = row["skipped_optim_steps"] and not row["optim_steps"]
            self.skipped_in_a_row = self.skipped_in_a_row + 1 if all_skipped else 0

    def after_eval(self, step: int, accuracy: float, save) -> None:
        """``save(folder)``: write this step's weights into ``folder`` (keeping only them) and return the path."""
        where = f"; the best checkpoint is {self.path}" if self.path else ""
        if self.best and accuracy < COLLAPSE_RATIO * self.best[1] and accuracy <= self.best[1] - COLLAPSE_MARGIN:
            say(f"step {step}: warning: held-out accuracy {accuracy:.3f} is far below its best, "
                f"{self.best[1]:.3f} at step {self.best[0]}: the policy may have collapsed (a lower "
                f"optimizer.lr?){where}")
        if self.skipped_in_a_row >= SKIPPED_IN_A_ROW:
            say(f"step {step}: warning: the last {self.skipped_in_a_row} steps skipped every optimiser step "
                f"(non-finite gradients, train.on_nonfinite=skip): nothing is learnt; lower optimizer.lr{where}")
        if self.best is None or accuracy > self.best[1]:
            self.best = (step, accuracy)
            if self.keep:
                try:
                    self.path, self.kept = save(self.folder), self.best
                except OSError as err:  # the run's own checkpoints matter more: it goes on without this one
                    say(f"step {step}: warning: its weights (the best held-out accuracy so far) were not kept: "
                        f"{err} The best kept is {self.path or 'none'}.")

    def summary_line(self) -> str:
        return f"{self.path} (accuracy {self.kept[1]:.3f}; python -m grpo.export {self.path} <out> exports it)"
