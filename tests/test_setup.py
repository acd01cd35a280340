"""What a user meets around a run, through the scripts as they start them: ``--help`` names the configs,
a short run is quiet and shows replies to read, sweep jobs are told apart in wandb and by ``resume=auto``."""

import gc
import re
import shutil
import subprocess
import sys
import uuid
import weakref
from statistics import mean

import pytest

from conftest import REPO
from grpo.loop.logger import read_metrics
from grpo.process import setup
from grpo.process.setup import freeze_long_lived_objects
from grpo.training.checkpoint import list_checkpoints, load_checkpoint

SMALL = ["eval.num_problems=8", "eval.batch_size=8", "env.num_envs=16", "env.repeats=4",
         "train.dialog_turns_per_batch=16", "train.optim_batch_size=8", "logging.progress_bar=false"]


def grpo(*args, multirun=False):
    proc = subprocess.run([sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-name", "grpo_tiny",
                           *(["--multirun"] if multirun else []), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.mark.parametrize("script", ["grpo.py", "grpo-async.py"])
def test_help_lists_every_config_before_torch_is_imported(script):
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "grpo" / script), "--help"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    names = sorted(p.stem for p in (REPO / "config").glob("*.yaml"))
    listed = re.findall(r"^  (grpo\w*) {2,}\S", proc.stdout, flags=re.M)
    assert sorted(listed) == names, proc.stdout[-2000:]  # config/hydra/help/grpo.yaml lists them, one line each
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported and not {"torch", "transformers"} & imported  # 0.7 s, not 9


def test_a_short_run_prints_no_warnings_and_shows_replies_with_their_rewards(tmp_path):
    """The defaults of grpo_tiny, its progress bar included; replies of every prompt every 2 steps."""
    run_dir = tmp_path / "run"
    proc = grpo(f"hydra.run.dir={run_dir}", "train.total_steps=4", "logging.samples_every=2",
                "logging.samples_count=8", "eval.num_problems=16")
    noisy = [line for line in (proc.stdout + proc.stderr).splitlines() if "warn" in line.lower()]
    assert not noisy, noisy
    assert not list(run_dir.glob("*.log"))  # Hydra's job log used to be an empty grpo.log / setup.log
    steps = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "reward" in r}
    samples = read_metrics(run_dir / "samples.jsonl")
    assert sorted({s["step"] for s in samples}) == [2, 4]
    for step in (2, 4):
        rows = [s for s in samples if s["step"] == step]
        assert len(rows) == 64  # every reply of the step: 8 prompts (samples_count) x 8 replies
        assert mean(r["reward"] for r in rows) == pytest.approx(steps[step]["reward"], abs=1e-6)
        assert sorted({r["row"] for r in rows}) == steps[step]["prompt_indices"]
        assert all(r["prompt"].strip() and r["reply"].strip() for r in rows)
        assert f"step {step}: replies (all of them in samples.jsonl)" in proc.stdout


def test_inductors_tf32_notice_is_not_shown_and_other_warnings_are():
    """On any Ampere or later GPU inductor's first compile warned that float32 matmuls do not use TF32: every GPU
    run printed it, and no user can act on it (grpo/__init__.py says why they stay float32). Here inductor's own
    check runs as on such a GPU, in a process that imported grpo as the scripts do."""
    code = """
import warnings
import torch
import grpo
from torch._inductor import compile_fx
torch.cuda.is_available = lambda: True
torch.cuda.get_device_capability = lambda *_: (9, 0)
compile_fx._warn_tf32_disabled.__wrapped__()
warnings.warn("another notice")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "another notice" in proc.stderr and "TensorFloat32" not in proc.stderr


def test_sweep_jobs_get_their_own_wandb_run_and_resume_auto_picks_their_own_run():
    """Both jobs of a sweep share one experiment_name; every job runs, with its own value (a constant schedule: the
    lr its step 1 logs is the one swept). A second sweep with resume=auto, its values in the other order, continues
    each job's own run: resume=auto used to take the newest run of the name."""
    name = f"test-sweep-{uuid.uuid4().hex[:8]}"
    root = REPO / "multirun" / name  # resume=auto searches the repo's outputs/ and multirun/
    common = [*SMALL, "train.total_steps=1", "optimizer.schedule=constant", f"logging.experiment_name={name}",
              "logger=wandb", "wandb.mode=offline"]
    try:
        first = root / "first"
        grpo(f"hydra.sweep.dir={first}", "optimizer.lr=1e-4,3e-4", *common, multirun=True)
        for job, lr in (("0", 1e-4), ("1", 3e-4)):
            assert [r["lr"] for r in read_metrics(first / job / "metrics.jsonl") if "lr" in r][:1] == [lr], job
            record = next((first / job / "wandb").glob("offline-run-*/run-*.wandb")).read_bytes()
            assert f"{name}-{job}".encode() in record and f"{name} {first}".encode() in record  # name, group
        grpo(f"hydra.sweep.dir={root / 'second'}", "optimizer.lr=3e-4,1e-4", "resume=auto", *common, multirun=True)
        for job, lr in (("0", 1e-4), ("1", 3e-4)):
            events = [r["event"] for r in read_metrics(first / job / "metrics.jsonl") if "event" in r]
            assert events == ["start", "resume"], (job, events)
            resumed = load_checkpoint(list_checkpoints(first / job / "checkpoints")[-1])  # saved again on resume
            assert resumed["config"]["optimizer"]["lr"] == lr
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("frozen_before", [False, True])
def test_freezing_takes_live_objects_out_of_the_collectors_scans_after_freeing_garbage(monkeypatch, frozen_before):
    """A run freezes what its first step built, so full collections stop walking it (0.28 s of every third collection
    on the tiny task); a garbage cycle alive only to the collector at that moment is freed, not frozen; later calls
    freeze nothing. Also when objects were frozen before (Python 3.12 starts with 375 of its own)."""
    class Node:
        pass

    monkeypatch.setattr(setup, "_long_lived_frozen", False)  # as in a fresh process
    gc.unfreeze()
    if frozen_before:
        library_object = Node()
        gc.freeze()
        assert gc.get_freeze_count() > 0 and not any(o is library_object for o in gc.get_objects())
    garbage, kept = Node(), Node()
    garbage.itself, kept.itself = garbage, kept  # cycles: only the collector frees them
    garbage_alive = weakref.ref(garbage)
    del garbage
    try:
        assert any(o is kept for o in gc.get_objects())
        freeze_long_lived_objects()
        assert garbage_alive() is None and gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # in the permanent generation: never scanned
        later = Node()
        later.itself = later
        freeze_long_lived_objects()  # once per process: a later call (each step calls it) freezes nothing more
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()
