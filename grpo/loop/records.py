"""What a run leaves behind in its run dir: metrics and samples (through ``RunLogger``), checkpoints,
the export, and the summary it ends with."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from grpo.export import export_model
from grpo.loop.best import BestCheckpoint
from grpo.loop.disk_room import HeldRoom
from grpo.loop.evaluation import gain_text
from grpo.loop.logger import RunLogger, read_metrics
from grpo.loop.settings import RecordSettings
from grpo.process.errors import RunDirError
from grpo.loop.trackers import TRACKER_DIRS
from grpo.process.console import say
from grpo.training import checkpoint as ckpt


def checkpoint_note(last_checkpoint: tuple[int, Path] | None, run_dir: Path) -> str:
    """Where a run can be continued from, for a line saying how it ended."""
    return f"the last checkpoint is {last_checkpoint[1]} (resume={run_dir})" if last_checkpoint else \
        "this run has no checkpoint"


def trajectory(rows: list[dict], name: str) -> str:
    """``first 0.324 (step 0) -> best 0.793 (step 30) -> last 0.793 (step 30)``: ``name`` over the eval rows."""
    evals = [(row["step"], row[name]) for row in rows if name in row]
    marks = {"first": evals[0], "best": max(evals, key=lambda e: e[1]), "last": evals[-1]}
    return " -> ".join(f"{mark} {value:.3f} (step {step})" for mark, (step, value) in marks.items())


def graphs_compiled() -> int:
    """Graphs torch.compile has made in this process so far, recompiles included (dynamo's own count)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class RunRecords:
    """``last_checkpoint``: (step, path) of the newest checkpoint this run can continue from; ``gpu_ids``: the
    GPUs this process computes on, whose peak memory each step reports; ``room``: the disk space its next
    checkpoint is sure of (None: it writes none); ``resolved_config``: the run's whole config, which each checkpoint
    keeps (what a resumed run is compared with)."""

    def __init__(self, settings: RecordSettings, run_dir: Path, resolved_config: dict, logger: RunLogger,
                 last_checkpoint: tuple[int, Path] | None, gpu_ids: list[int], room: HeldRoom | None = None):
        self.run_dir, self.resolved_config, self.logger, self.gpu_ids = run_dir, resolved_config, logger, gpu_ids
        self.checkpoint_dir, self.keep_last = run_dir / settings.checkpoint_dir, settings.keep_last
        self.last_checkpoint, self.room = last_checkpoint, room
        self.trackers = settings.trackers  # where the summary points
        rows = read_metrics(logger.path)  # a resumed run's, up to its checkpoint
        self.best = BestCheckpoint(settings.keep_best, run_dir, rows)
        self.train_seconds = sum(row.get("step_time_s", 0.0) for row in rows)  # the clock train.max_minutes reads
        self.export_dir: Path | None = None  # written when the run finishes
        self.postfix: dict = {}  # the progress bar's: the last step's reward and KL
        self.graphs_before = 0  # graphs_compiled() when the step started

    def start_step(self) -> float:
        """A step begins: its clock (``log_step``'s ``t0``) and the compile count its row is measured from."""
        self.graphs_before = graphs_compiled()
        return time.perf_counter()

    def log_step(self, step: int, metrics: dict, t0: float) -> None:
        metrics["step_time_s"] = time.perf_counter() - t0
        self.train_seconds += metrics["step_time_s"]
        # a step that compiled says so (an eval's compiles fall between steps, in neither): the real 0.5B's train
        # part took 11-12 s instead of 1.5 s on 2 of 8 steps
        metrics["graphs_compiled"] = graphs_compiled() - self.graphs_before
        if self.gpu_ids and torch.cuda.is_initialized():
            # this step's peak over the GPUs this process uses (generation usually sets it)
            metrics["gpu_peak_memory_gb"] = max(torch.cuda.max_memory_allocated(i) for i in self.gpu_ids) / 2**30
            for i in self.gpu_ids:
                torch.cuda.reset_peak_memory_stats(i)
        self.logger.log({"step": step, **metrics})
        self.best.count_skips(metrics)
        if metrics.get("skipped_optim_steps"):
            skipped = metrics["skipped_optim_steps"]
            say(f"step {step}: {skipped} of {skipped + metrics['optim_steps']} optimiser steps "
                "skipped (a non-finite gradient, train.on_nonfinite=skip)")
        self.postfix = {"reward": f"{metrics['reward']:.3f}", "kl": f"{metrics.get('kl_to_ref', 0):.4f}"}

    def save_checkpoint(self, step: int, trainer, counters: dict, extras: dict, rng: dict | None = None) -> None:
        """``rng``: RNG states to store instead of the current ones. It is written into the room held for it, which
        is taken back for the next one after (``check_room`` says whether it could)."""
        then = f"resume={self.run_dir}" if self.last_checkpoint else "run again (this run has no checkpoint)"
        self.room.release()

        def committed(path: Path) -> None:  # what a stop signal from now on names
            self.last_checkpoint = (step, path)

        try:
            path = ckpt.save_checkpoint(
                str(self.checkpoint_dir), step, state=trainer.checkpoint_state(), counters=counters,
                resolved_config=self.resolved_config, extra={"wandb_run_id": self.logger.wandb_run_id, **extras},
                keep_last=self.keep_last, rng=rng, then=then, committed=committed)
        finally:
            self.room.take()
        say(f"step {step}: checkpoint {path}")

    def after_eval(self, step: int, accuracy: float, trainer, counters: dict) -> None:
        """A collapse warns; a new best held-out accuracy keeps this step's weights (``logging.keep_best``)."""
        def save(folder: Path) -> Path:
            # the weights alone (what an export reads: a third of a checkpoint), never in the room held: the run's
            # next checkpoint needs it (on a disk filled mid-run, a best written from it took the final checkpoint's)
            state = {"model": trainer.checkpoint_state()["model"], "optimizer": {}, "scheduler": {}}
            return ckpt.save_checkpoint(str(folder), step, state=state, counters=counters,
                                        resolved_config=self.resolved_config, keep_last=1, then="the run goes on")

        self.best.after_eval(step, accuracy, save)

    def check_room(self) -> None:
        """Stop on the checkpoint just written when the disk has no room left for the next one: the run would
        otherwise train on towards a checkpoint it cannot write."""
        if not self.room.held:
            free = ckpt.shutil.disk_usage(self.run_dir).free
            raise RunDirError(f"{self.run_dir}'s disk is full ({ckpt.size_text(free)} free): no room for the next "
                              f"checkpoint ({ckpt.size_text(self.room.size)}); the run stops on its last, "
                              f"{self.last_checkpoint[1]}. Free {ckpt.size_text(self.room.size - free)} there (older "
                              f"run dirs, logging.keep_last=1), then resume={self.run_dir} continues from it.")

    def last_checkpoint_note(self) -> str:
        return checkpoint_note(self.last_checkpoint, self.run_dir)

    def export(self, step: int, policy_model, weights: dict, tokenizer) -> None:
        """``<run dir>/export``: the policy, with ``weights`` (``Trainer.whole_weights``), as a Hugging Face folder
        (a resumed run's replaces the earlier one)."""
        export_dir = self.run_dir / "export"
        shutil.rmtree(export_dir, ignore_errors=True)
        self.export_dir = export_model(policy_model, tokenizer, export_dir, state=weights)
        say(f"step {step}: exported the policy to {export_dir}")

    def summary(self, ended: str) -> str:
        """Where a run left its outputs, and how its held-out accuracy went: first -> best -> last eval."""
        run_dir = self.run_dir
        every_row = read_metrics(run_dir / "metrics.jsonl")
        rows = [row for row in every_row if "eval/accuracy" in row]
        if rows:
            accuracy = trajectory(rows, "eval/accuracy")
            if "eval/gain" in rows[-1]:  # the last against the first, on the same problems: its paired error
                accuracy += f": {gain_text(rows[-1])}"
        else:
            accuracy = "no eval ran"
        skipped = sum(row.get("skipped_optim_steps", 0) for row in every_row)
        sampled = [name for name in (rows[-1] if rows else {}) if name.startswith(("eval/pass@", "eval/avg@"))
                   and not name.endswith("_stderr")]  # eval.samples_per_problem's
        plot = run_dir / "metrics.png"
        path = self.last_checkpoint[1] if self.last_checkpoint else None  # eval only: the one evaluated, if any
        checkpoint = f"{path} (resume={path.parent.parent} continues from it)" if path else "none"
        export = (f"{self.export_dir} (transformers' from_pretrained and vllm serve load it)" if self.export_dir
                  else f"none (python -m grpo.export {path} <out> writes one)" if path else "none")
        return "\n".join([
            f"run {ended}: {run_dir}",
            f"  eval accuracy  {accuracy}",
            *(f"  {'eval ' + name.removeprefix('eval/'):<15}{trajectory(rows, name)}" for name in sampled),
            f"  metrics        {run_dir / 'metrics.jsonl'}" + (f", {plot}" if plot.exists() else ""),
            *([f"  eval replies   {replies}"] if (replies := run_dir / "eval_replies.jsonl").exists() else []),
            *([f"  loggers        {', '.join(f'{name} {run_dir / TRACKER_DIRS[name]}' for name in self.trackers)}"]
              if self.trackers else []),
            f"  checkpoint     {checkpoint}",
            *([f"  best           {self.best.summary_line()}"] if self.best.path else []),
            f"  export         {export}",
            *([f"  skipped        {skipped} optimiser steps (non-finite gradients, train.on_nonfinite=skip)"]
              if skipped else []),
        ])
