"""Checkpoints: trainable weights (or only LoRA adapters), optimiser, LR schedule,
counters, RNG states and the resolved config, written atomically (temp file + rename)."""

from __future__ import annotations

import json
import os
import random
import re
import warnings
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from grpo.errors import ResumeError
from grpo.logger import read_metrics

CKPT_PATTERN = re.compile(r"^step_(\d+)\.pt$")


def trainable_state_dict(model) -> dict:
    """Only what training changes: every weight of a full fine-tune, the adapters of a LoRA one."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k in names}


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(ckpt_dir: Path, step: int, *, model, optimizer, scheduler, counters: dict,
                    resolved_config: dict, extra: dict | None = None, keep_last: int | None = None) -> Path:
    ckpt_dir = Path(ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "step": step,
        "model": trainable_state_dict(model),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "counters": counters,
        "rng": rng_state(),
        "config": resolved_config,
        **(extra or {}),
    }
    path = ckpt_dir / f"step_{step:08d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(payload, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: a reader sees the old set of files or the new complete one
    if keep_last:
        for old in list_checkpoints(ckpt_dir)[:-keep_last]:
            old.unlink(missing_ok=True)
    return path


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := CKPT_PATTERN.match(p.name))]
    return [p for _, p in sorted(found)]


def load_latest_good(ckpt_dir: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint that loads; corrupt or partial ones are skipped with a warning."""
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return path, torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:  # truncated zip, bad pickle, ... all mean "not usable"
            warnings.warn(f"checkpoint {path} is unreadable ({type(err).__name__}: {err}); trying an older one")
    return None


PAYLOAD_KEYS = ("step", "model", "optimizer", "scheduler", "counters", "rng", "config")


def check_resumable(path: Path, payload, cfg) -> None:
    """A ResumeError unless ``payload`` is one of our checkpoints, of the model and adapters this run trains."""
    missing = [key for key in PAYLOAD_KEYS if key not in payload] if isinstance(payload, dict) else PAYLOAD_KEYS
    if missing:
        raise ResumeError(f"resume: {path} is not a checkpoint of this project (it lacks {list(missing)}); give a run "
                          "dir or one of its checkpoints/step_*.pt.")
    run_dir = path.parent.parent
    if path.parent.name != cfg.logging.checkpoint_dir or not (run_dir / "metrics.jsonl").is_file():
        raise ResumeError(f"resume: {path} is not in a run dir's {cfg.logging.checkpoint_dir}/ folder (next to its "
                          "metrics.jsonl), and a resumed run continues in that run dir; give the run dir it came from.")
    saved = payload["config"]
    for section, key in (("model", "name"), ("train_model", "lora")):
        was, now = saved.get(section, {}).get(key), OmegaConf.to_container(cfg[section], resolve=True)[key]
        if was != now:
            raise ResumeError(f"resume: {path} was made with {section}.{key}={was!r}, this run has {now!r}; pass "
                              f"{section}.{key} as it was, or start without resume.")


def restore_training_state(payload: dict, *, model, optimizer, scheduler) -> None:
    try:
        _, unexpected = model.load_state_dict(payload["model"], strict=False)
    except RuntimeError as err:  # size mismatch: another model shape than check_resumable could tell
        raise ResumeError(f"resume: the checkpoint's weights do not fit this model ({str(err).splitlines()[1:2]}); "
                          "resume with the model it was trained from.") from err
    if unexpected:
        raise ResumeError(f"resume: the checkpoint holds weights this model lacks ({unexpected[:5]}); resume with the "
                          "model it was trained from.")
    optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    set_rng_state(payload["rng"])


def find_checkpoint(resume: str, *, experiment_name: str, search_roots: list[Path]) -> tuple[Path, dict]:
    """The checkpoint ``resume=`` points at: a checkpoint file, a run dir (its latest good one),
    or ``auto`` (the latest run of ``experiment_name`` under ``search_roots`` that has one)."""
    if resume == "auto":
        candidates = []
        for root in search_roots:
            for cfg_file in Path(root).glob("**/.hydra/config.yaml"):
                run_dir = cfg_file.parent.parent
                if f"experiment_name: {experiment_name}\n" in cfg_file.read_text() and list_checkpoints(
                        run_dir / "checkpoints"):
                    candidates.append(run_dir)
        for run_dir in sorted(candidates, key=lambda d: max(p.stat().st_mtime for p in list_checkpoints(
                d / "checkpoints")), reverse=True):
            found = load_latest_good(run_dir / "checkpoints")
            if found:
                return found
        raise ResumeError(f"resume=auto: no run of logging.experiment_name={experiment_name!r} with a readable "
                          f"checkpoint under {[str(r) for r in search_roots]}; start without resume.")
    path = Path(resume).expanduser()
    if path.is_file():
        try:
            return path, torch.load(path, map_location="cpu", weights_only=False)
        except Exception as err:
            previous = load_latest_good(path.parent)
            if previous is None:
                raise ResumeError(f"resume={resume}: unreadable ({type(err).__name__}) and no older checkpoint "
                                  "beside it.") from err
            warnings.warn(f"resume={resume} is unreadable ({type(err).__name__}); using {previous[0]}")
            return previous
    for folder in (path / "checkpoints", path):
        found = load_latest_good(folder)
        if found:
            return found
    raise ResumeError(f"resume={resume}: no readable step_*.pt checkpoint there or in its checkpoints/ folder; "
                      "give a run dir, a checkpoint file, or resume=auto.")


def truncate_metrics(metrics_path: Path, step: int) -> None:
    """Drop rows logged after ``step`` (a resumed run re-does those steps) and a torn last line."""
    if not metrics_path.exists():
        return
    kept = [row for row in read_metrics(metrics_path) if row.get("step", 0) <= step]
    tmp = metrics_path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
    os.replace(tmp, metrics_path)
