"""What ``resume=`` means: which checkpoint it points at (a file, a run dir, or ``auto``: this command's
own latest run), whether that checkpoint may continue this run, and the rows of the run dir's files
that a resumed run re-does."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from omegaconf import OmegaConf

from grpo.loop.config import inference_is_cap_now
from grpo.loop.logger import read_metrics
from grpo.loop.settings import ResumeSettings
from grpo.process.errors import ResumeError
from grpo.training.checkpoint import CKPT_PATTERN, FRESH, PICKLED, list_checkpoints, load_checkpoint, load_latest_good


PAYLOAD_KEYS = ("step", "model", "optimizer", "scheduler", "counters", "rng", "config")


def check_resumable(path: Path, payload, settings: ResumeSettings, resolved_config: dict) -> None:
    """A ResumeError unless ``payload`` is one of our checkpoints, of the model and adapters this run trains.
    ``resolved_config``: this run's whole config, compared with the one the checkpoint keeps."""
    missing = [key for key in PAYLOAD_KEYS if key not in payload] if isinstance(payload, dict) else PAYLOAD_KEYS
    if missing:
        raise ResumeError(f"resume: {path} is not a checkpoint of this project (it lacks {list(missing)}); give a run "
                          "dir or one of its checkpoints/step_*.json.")
    run_dir = path.parent.parent
    if path.parent.name != settings.checkpoint_dir or not (run_dir / "metrics.jsonl").is_file():
        raise ResumeError(f"resume: {path} is not in a run dir's {settings.checkpoint_dir}/ folder (next to its "
                          "metrics.jsonl), and a resumed run continues in that run dir; give the run dir it came from.")
    saved = payload["config"]
    for section, key in (("model", "name"), ("train_model", "lora")):
        was, now = saved.get(section, {}).get(key), resolved_config[section][key]
        if was != now:
            raise ResumeError(f"resume: {path} was made with {section}.{key}={was!r}, this run has {now!r}; pass "
                              f"{section}.{key} as it was, or start without resume.")
    if settings.total_steps == 0:  # evaluation only: nothing is trained on, any config may read the weights
        return
    if payload["step"] > settings.total_steps:  # it ended "run finished", rc 0, having trained nothing
        done = payload["step"]
        raise ResumeError(f"resume: {path} is at step {done}, past train.total_steps={settings.total_steps}: nothing "
                          f"is left to train; pass train.total_steps above {done} (or 0 to evaluate it).")
    cap = _select(saved, "train.inference_is_cap")
    now = (settings.importance_sampling, settings.is_high)
    if cap is not None and now != ("token_truncate", cap) and not settings.allow_changes:
        raise ResumeError(f"resume: {path} was trained with train.inference_is_cap={cap}, retired: pass "
                          f"{inference_is_cap_now(cap)} to go on as it did (or resume_allow_changes=true).")
    changed = [f"{key}={_select(saved, key)!r} -> {_select(resolved_config, key)!r}"
               for key in meaning_keys(settings.schedule) if _select(saved, key) != _select(resolved_config, key)]
    if changed and settings.allow_changes:
        warnings.warn(f"resume: {path} continues with a changed meaning (resume_allow_changes=true): {'; '.join(changed)}")
    elif changed:
        raise ResumeError(f"resume: this run changes what {path}'s run means ({'; '.join(changed)}): its prompt stream, "
                          "learning-rate schedule or data would not be the ones it was trained with. Pass them as they "
                          "were, or resume_allow_changes=true to continue anyway.")


def meaning_keys(schedule: str) -> list[str]:
    """What a resumed run may not change unasked: the data and its order, the batch the prompt stream counts
    in, the learning-rate schedule (with a cosine schedule, its length: train.total_steps, in optimiser steps
    of train.optim_batch_size replies). ``schedule``: optimizer.schedule."""
    keys = ["env.task", "env.dataset", "env.train_split", "env.repeats", "env.system_prompt",
            "train.dialog_turns_per_batch", "train.epochs", "optimizer.lr", "optimizer.schedule",
            "optimizer.warmup_steps", "optimizer.min_lr_ratio"]
    return keys + (["train.total_steps", "train.optim_batch_size"] if schedule == "cosine" else [])


def _select(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def find_checkpoint(resume: str, *, experiment_name: str, search_roots: list[Path],
                    overrides: list[str] = ()) -> tuple[Path, dict]:
    """The checkpoint ``resume=`` points at: a checkpoint file, a run dir (its latest good one),
    or ``auto``: the latest run under ``search_roots`` with a checkpoint, of ``experiment_name`` and started
    with the same command-line ``overrides`` (this run's, as Hydra records them; ``resume=`` aside). So a
    relaunched command continues its own run, and a sweep job (``--multirun``) the job of an earlier sweep
    with the same values, never a sibling's."""
    if resume == "auto":
        wanted = _without_resume(overrides)
        candidates = []
        for root in search_roots:
            for cfg_file in Path(root).glob("**/.hydra/config.yaml"):
                run_dir = cfg_file.parent.parent
                if (f"experiment_name: {experiment_name}\n" in cfg_file.read_text()
                        and _without_resume(_overrides_of(run_dir)) == wanted
                        and list_checkpoints(run_dir / "checkpoints")):
                    candidates.append(run_dir)
        for run_dir in sorted(candidates, key=lambda d: max(p.stat().st_mtime for p in list_checkpoints(
                d / "checkpoints")), reverse=True):
            found = load_latest_good(run_dir / "checkpoints")
            if found:
                return found
        raise ResumeError(f"resume=auto: no run of logging.experiment_name={experiment_name!r} with the overrides "
                          f"{wanted} and a readable checkpoint under {[str(r) for r in search_roots]}; {PICKLED}; "
                          "pass the overrides the run was started with, resume=<its run dir>, or start without resume.")
    path = Path(resume).expanduser()
    if path.is_file():
        if not CKPT_PATTERN.match(path.name):
            raise ResumeError(f"resume={resume}: {PICKLED}; {FRESH}" if path.suffix == ".pt" else
                              f"resume={resume}: not a checkpoint; give a run dir or one of its "
                              "checkpoints/step_*.json.")
        try:
            return path, load_checkpoint(path)
        except Exception as err:
            previous = load_latest_good(path.parent)
            if previous is None:
                raise ResumeError(f"resume={resume}: unreadable ({type(err).__name__}: {err}) and no older "
                                  "checkpoint beside it.") from err
            warnings.warn(f"resume={resume} is unreadable ({type(err).__name__}: {err}); using {previous[0]}")
            return previous
    for folder in (path / "checkpoints", path):
        found = load_latest_good(folder)
        if found:
            return found
    pickled = list(path.glob("step_*.pt")) + list(path.glob("checkpoints/step_*.pt"))
    raise ResumeError(f"resume={resume}: {PICKLED}; {FRESH}" if pickled else
                      f"resume={resume}: no readable step_*.json checkpoint there or in its checkpoints/ folder; "
                      "give a run dir, a checkpoint file, or resume=auto.")


def _overrides_of(run_dir: Path) -> list[str]:
    """The command-line overrides Hydra recorded for a run (none when it has no record)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    return list(OmegaConf.load(path)) if path.is_file() else []


def _without_resume(overrides: list[str]) -> list[str]:
    return sorted(o for o in overrides if o.split("=", 1)[0].lstrip("+~") != "resume")


def truncate_metrics(metrics_path: Path, step: int) -> None:
    """Drop rows logged after ``step`` (a resumed run re-does those steps) and a torn last line."""
    if not metrics_path.exists():
        return
    kept = [row for row in read_metrics(metrics_path) if row.get("step", 0) <= step]
    tmp = metrics_path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
    os.replace(tmp, metrics_path)
