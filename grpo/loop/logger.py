"""Run outputs: ``metrics.jsonl`` (one JSON object per logged step), ``samples.jsonl`` (replies
to read, one JSON object each), ``eval_scores.jsonl`` (each eval's per-problem scores), ``eval_replies.jsonl`` (each
eval's greedy replies, one a problem), plots, and the same rows to ``logger=``'s trackers (``grpo.loop.trackers``:
wandb, TensorBoard, MLflow, CSV).

Each row is written and flushed as soon as it is logged, so a killed run keeps every
row up to its last step. Each write first checks that the run dir is still where it was: one deleted or
moved under the run gets its files written back in place, and the run stops (``RunDirError``). wandb runs
offline when no API key is configured.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import warnings
from pathlib import Path

import torch

from grpo.loop.settings import RecordSettings
from grpo.loop.trackers import start_trackers
from grpo.process.console import say
from grpo.process.errors import RunDirError
from grpo.training.batch import group_ids
from grpo.training.replies import Replies

# metrics.png: one panel per entry, its metrics as lines (eval rows as markers, with error bars where a
# <name>_stderr is logged). Held-out accuracy sits beside its strict and flexible forms, and reply length and
# truncation beside their eval values, so a recipe that learns a format and drops its reasoning shows in one
# look; eval/gain is the accuracy gained since the first eval, on the same problems. A name may be a pattern
# (fnmatch): eval/pass@k's k is eval.samples_per_problem.
PANELS = [("reward",), ("eval/accuracy", "eval/strict_accuracy", "eval/flexible_accuracy", "eval/answer_rate",
                       "eval/pass@*", "eval/avg@*"),
          ("eval/gain",), ("kl_to_ref",), ("loss_objective",), ("clip_fraction",), ("ess",), ("entropy",),
          ("response_length", "eval/response_length"), ("response_truncated_fraction", "eval/truncated_fraction"),
          ("grad_norm",)]
SAMPLE_COLUMNS = ["step", "group", "row", "prompt", "reply", "reward"]
# the files of rows beside metrics.jsonl, each opened at its first row (a run that logs none gets no file); a resume
# drops their rows past its checkpoint's step, as metrics.jsonl's
ROW_FILES = ("samples.jsonl", "eval_scores.jsonl", "eval_replies.jsonl")
CONSOLE_WIDTH = 110  # characters of a prompt or reply on the console; samples.jsonl keeps them whole


class RunLogger:
    """``resolved_config``: the run's whole config, which the trackers keep with the run (wandb's config)."""

    def __init__(self, run_dir: Path, settings: RecordSettings, resolved_config: dict, *,
                 wandb_run_id: str | None = None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self._file = open(self.path, "a+", buffering=1)  # a+: readable, for putting it back (_put_back)
        self._row_files = {}  # ROW_FILES' name -> its file, once opened
        # the run's config record (what resume=auto finds it by): small, held to be put back too
        self._hydra = {p: p.read_bytes() for p in sorted((self.run_dir / ".hydra").glob("*.yaml"))}
        self.failed = False  # a write failed (and said so): closing then only lets go of the files
        self.trackers = start_trackers(settings, self.run_dir, resolved_config, wandb_run_id)

    @property
    def wandb_run_id(self) -> str | None:
        return next((t.logger.experiment.id for t in self.trackers if t.kind == "wandb"), None)

    def log(self, row: dict) -> None:
        row = {k: (float(v) if hasattr(v, "item") else v) for k, v in row.items()}
        self._write(self._file, json.dumps(row) + "\n")
        for tracker in self.trackers:
            tracker.log(row)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Replies to read (``reply_samples``' rows): appended to ``samples.jsonl``, printed in short, and given to
        the trackers (wandb's table ``samples``, the others the printed text)."""
        rows = [{"step": step, **sample} for sample in samples]
        self._append_rows("samples.jsonl", rows)
        text = "\n".join(console_lines(step, rows))
        say(text)
        for tracker in self.trackers:
            tracker.samples(step, rows, SAMPLE_COLUMNS, text)

    def log_eval_scores(self, step: int, scores: list[float]) -> None:
        """Appends one eval's per-problem scores to ``eval_scores.jsonl``, in problem order (every eval of a run
        scores the same problems): what ``first_eval_scores`` pairs later evals with."""
        self._append_rows("eval_scores.jsonl", [{"step": step, "scores": scores}])

    def log_eval_replies(self, step: int, replies: list[dict]) -> None:
        """Appends one eval's greedy replies (``eval_reply_rows``' rows, in problem order) to ``eval_replies.jsonl``."""
        self._append_rows("eval_replies.jsonl", [{"step": step, **reply} for reply in replies])

    def first_eval_scores(self) -> tuple[int, list[float]] | None:
        """The step and per-problem scores of this run dir's first eval (a resumed run's included), if any."""
        path = self.run_dir / "eval_scores.jsonl"
        rows = read_metrics(path) if path.exists() else []
        return (rows[0]["step"], rows[0]["scores"]) if rows else None

    def _append_rows(self, name: str, rows: list[dict]) -> None:
        if name not in self._row_files:
            self._row_files[name] = self._open_for_append(name)
        self._write(self._row_files[name], "".join(json.dumps(row) + "\n" for row in rows))

    def _open_for_append(self, name: str):
        """The run dir's file ``name``, line-buffered for appending (each row reaches the disk as it is written)."""
        path = self.run_dir / name
        try:
            return open(path, "a+", buffering=1)
        except OSError as err:
            raise self._failure(path, err) from err

    def _write(self, file, text: str) -> None:
        try:
            moved = self._moved()
            if moved:
                file = self._put_back()[file]
            file.write(text)
        except OSError as err:  # a full disk mid-run: one line, not a traceback from the middle of a step
            raise self._failure(Path(file.name), err) from err
        if moved:
            self.failed = True
            raise RunDirError(f"{self.run_dir} was {moved} while the run went on: its metrics are written there again, "
                              f"with a checkpoint of its last finished step, and the run stops; resume={self.run_dir} "
                              "continues it.")

    def _moved(self) -> str | None:
        """How the run dir left its place (deleted, moved), judged by metrics.jsonl: is the file at its path still
        the one this logger writes?"""
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return "deleted or moved"
        here = os.fstat(self._file.fileno())
        return None if (there.st_dev, there.st_ino) == (here.st_dev, here.st_ino) else "replaced"

    def _put_back(self) -> dict:
        """Each open file's rows written again at its path (from the file still open: a deleted file stays
        readable until closed), and written there from now on, with ``.hydra/``; returns the new file of each old
        one."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for path, record in self._hydra.items():
            path.parent.mkdir(exist_ok=True)
            path.write_bytes(record)
        new = {}
        for old in (self._file, *self._row_files.values()):
            old.seek(0)
            rows = old.read()
            old.close()
            new[old] = open(old.name, "w+", buffering=1)
            new[old].write(rows)
        self._file = new[self._file]
        self._row_files = {name: new[file] for name, file in self._row_files.items()}
        return new

    def _failure(self, path: Path, err: OSError) -> RunDirError:
        self.failed = True
        return RunDirError(f"{path} could not be written ({err.strerror or err}); free space on its disk (or make "
                           f"it writable), then resume={self.run_dir} continues from the run's last checkpoint.")

    def close(self, exit_code: int = 0) -> None:
        for file in (self._file, *self._row_files.values()):
            try:
                file.close()  # closed even when its flush fails
            except OSError as err:
                if not self.failed:  # a failed write said so already; its buffered rest fails again here
                    raise self._failure(Path(file.name), err) from err
        png = self.run_dir / "metrics.png"
        try:
            if not self.failed:  # its disk, full, just failed a write
                plot_metrics(self.path, png)
        except OSError as err:  # a plot: metrics.jsonl holds what it shows
            warnings.warn(f"metrics.png not written ({err.strerror or err}); metrics.jsonl holds the same rows")
        trackers, self.trackers = self.trackers, []
        last_step = max((row["step"] for row in read_metrics(self.path)), default=0) if not self.failed else 0
        for tracker in trackers:
            if png.exists() and not self.failed:
                tracker.image("metrics", png, last_step)
            tracker.close(exit_code)


def reply_samples(replies: Replies, count: int, tokenizer) -> list[dict]:
    """Every episode of the batch's first ``count`` prompts, one row each: ``group`` (the prompt's place among
    the batch's prompts), ``row`` (its data row), ``prompt`` (the user's message, as the chat history holds
    it), ``reply`` (the episode's tokens as trained on, decoded without special tokens; the environment's turns
    marked ``⟦env: ...⟧``) and ``reward`` (the env's, before any KL term)."""
    samples = []
    for group, row, prompt, reply, sampled, reward in zip(
            group_ids(replies).tolist(), replies.row_index.tolist(), replies.user_prompts, replies.replies(),
            replies.sampled_masks(), replies.reward.tolist()):
        if group < count:
            samples.append({"group": group, "row": row, "prompt": prompt, "reply": episode_text(reply, sampled, tokenizer),
                            "reward": reward})
    return samples


def eval_reply_rows(replies: Replies, scores: list[float], tokenizer) -> list[dict]:
    """An eval's episodes, one row each in problem order: ``row`` (its data row), ``prompt`` (the user's message),
    ``reply`` (as ``reply_samples``' rows hold it) and ``score`` (``eval/accuracy``'s)."""
    return [{"row": row, "prompt": prompt, "reply": episode_text(reply, sampled, tokenizer), "score": score}
            for row, prompt, reply, sampled, score in zip(replies.row_index.tolist(), replies.user_prompts,
                                                          replies.replies(), replies.sampled_masks(), scores)]


def episode_text(tokens: torch.Tensor, sampled: torch.Tensor, tokenizer) -> str:
    """An episode as one text: the model's turns as decoded, each environment turn as ``⟦env: its text⟧``."""
    pieces, start = [], 0
    for end in [*(torch.nonzero(sampled[1:] != sampled[:-1])[:, 0] + 1).tolist(), len(tokens)]:
        text = tokenizer.decode(tokens[start:end], skip_special_tokens=True)
        pieces.append(text if bool(sampled[start]) else f" ⟦env: {text.strip()}⟧ ")
        start = end
    return "".join(pieces).strip()


def console_lines(step: int, rows: list[dict]) -> list[str]:
    """Each prompt once, then its replies one line each, led by their rewards."""
    lines = [f"step {step}: replies (all of them in samples.jsonl)"]
    for group in dict.fromkeys(r["group"] for r in rows):
        replies = [r for r in rows if r["group"] == group]
        lines.append(f"  row {replies[0]['row']}: {_one_line(replies[0]['prompt'])}")
        lines += [f"    {r['reward']:6.3f}  {_one_line(r['reply'])}" for r in replies]
    return lines


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= CONSOLE_WIDTH else flat[:CONSOLE_WIDTH - 1] + "…"


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
    """Every row of a JSON-lines file of the run dir; a torn last line (the run was killed while writing it) is
    dropped, and a damaged one elsewhere skipped with a warning naming the file and the line (it stopped
    resume and the plot with a bare ``JSONDecodeError: line 1 column 603``)."""
    lines = Path(path).read_text(errors="replace").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a {type(row).__name__}, not an object")
        except ValueError as err:  # JSONDecodeError among them
            if i < last:
                warnings.warn(f"{path}, line {i + 1}: not a JSON row ({err}); skipped",
                              stacklevel=2)
            continue
        rows.append(row)
    return rows


def plot_metrics(metrics_path: Path, out_png: Path) -> None:
    """One panel per entry of ``PANELS`` against the step; eval rows as markers."""
    try:
        import matplotlib
    except ImportError:  # a bare GPU image may lack it; the metrics file is what matters
        warnings.warn("matplotlib is not installed: no metrics.png (pip install matplotlib)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    names = sorted({name for row in rows for name in row if not name.endswith("_stderr")})
    panels = [[n for pattern in panel for n in fnmatch.filter(names, pattern)] for panel in PANELS]
    panels = [panel for panel in panels if panel]
    if not panels:
        return
    cols = 3
    n_rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(n_rows, cols, figsize=(12, 3 * n_rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for name in panel:
            pts = [(r["step"], r[name], r.get(f"{name}_stderr")) for r in rows if name in r and r[name] is not None]
            steps, values, errors = zip(*pts)
            ax.errorbar(steps, values, yerr=None if None in errors else errors, capsize=2,
                        marker="o" if name.startswith("eval/") else None, markersize=4, label=name)
        ax.set_title(panel[0], y=1.0)  # where matplotlib puts it; placing it itself measured the axes first
        ax.set_xlabel("step")
        if len(panel) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    # fixed margins: tight_layout measured every tick label first, over half the plot's time (~1 s a run)
    fig.subplots_adjust(left=0.06, right=0.99, bottom=0.25 / n_rows, top=1 - 0.15 / n_rows, wspace=0.25,
                        hspace=0.5)
    fig.savefig(out_png, dpi=80)
    plt.close(fig)
