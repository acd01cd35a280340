"""Checkpoints restore the same state: resumed runs equal straight ones, kills lose nothing."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, TINY_DATA, TINY_MODEL
from conftest import compose
from grpo.checkpoint import (check_resumable, find_checkpoint, list_checkpoints, load_latest_good,
                             restore_training_state, save_checkpoint, truncate_metrics)
from grpo.errors import ResumeError

SMALL = [f"model.name={TINY_MODEL}", f"env.dataset={TINY_DATA}", "eval.num_problems=8", "eval.batch_size=8",
         "eval.frequency=0", "env.num_envs=16", "env.repeats=4", "train.dialog_turns_per_batch=16",
         "train.optim_batch_size=8", "train.epochs=2", "inference_model.max_new_tokens=16",
         "optimizer.warmup_steps=0", "logging.progress_bar=false"]
EXACT_KEYS = ["reward", "loss_objective", "grad_norm", "clip_fraction", "ess", "prompt_indices"]
# Averages of near-zero diagnostics (KL ~1e-14 at the start) can differ in the last bits between
# processes: CPU reductions take alignment-dependent vectorised paths. They must agree to 1e-6.
CLOSE_KEYS = ["kl_to_ref", "kl_to_inference", "entropy"]


def grpo_cmd(run_dir, *overrides):
    return [sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-name", "grpo_tiny",
            f"hydra.run.dir={run_dir}", *SMALL, *overrides]


def run(run_dir, *overrides):
    proc = subprocess.run(grpo_cmd(run_dir, *overrides), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def step_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward" in r}


def final_weights(run_dir):
    path = list_checkpoints(run_dir / "checkpoints")[-1]
    return torch.load(path, map_location="cpu", weights_only=False)["model"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    run(run_dir, "train.total_steps=4")
    return run_dir


def test_half_then_resume_equals_straight_run(straight, tmp_path):
    run(tmp_path, "train.total_steps=2")
    run(tmp_path / "again", "train.total_steps=4", f"resume={tmp_path}")  # new hydra dir, continues tmp_path
    a, b = step_rows(straight), step_rows(tmp_path)
    assert sorted(b) == [1, 2, 3, 4]
    for step in range(1, 5):
        for key in EXACT_KEYS:
            assert a[step][key] == b[step][key], (step, key)  # bitwise on CPU
        for key in CLOSE_KEYS:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-6, abs=1e-9), (step, key)
    wa, wb = final_weights(straight), final_weights(tmp_path)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_sigkill_then_resume_has_no_gap_or_duplicate(straight, tmp_path):
    proc = subprocess.Popen(grpo_cmd(tmp_path, "train.total_steps=4", "train.checkpoint_frequency=1"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    kill_after = random.Random(os.getpid()).randint(1, 3)
    deadline = time.time() + 400
    while time.time() < deadline and proc.poll() is None:
        if (tmp_path / "metrics.jsonl").exists() and len(step_rows(tmp_path)) >= kill_after:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    time.sleep(random.Random(kill_after).uniform(0, 1.5))  # land anywhere inside the next step
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    run(tmp_path / "again", "train.total_steps=4", "train.checkpoint_frequency=1", f"resume={tmp_path}")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "reward" in r]
    assert steps == [1, 2, 3, 4]
    consumed = [step_rows(tmp_path)[s]["prompt_indices"] for s in steps]
    assert consumed == [step_rows(straight)[s]["prompt_indices"] for s in steps]
    flat = [i for batch in consumed for i in batch]
    assert len(flat) == len(set(flat))


def test_sigterm_checkpoints_at_step_boundary_and_resumes(tmp_path):
    proc = subprocess.Popen(grpo_cmd(tmp_path, "train.total_steps=50"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 400
    while time.time() < deadline and not ((tmp_path / "metrics.jsonl").exists() and step_rows(tmp_path)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    saved = torch.load(list_checkpoints(tmp_path / "checkpoints")[-1], weights_only=False)
    assert saved["step"] == max(step_rows(tmp_path)) < 50
    run(tmp_path / "again", f"train.total_steps={saved['step'] + 1}", f"resume={tmp_path}")
    assert max(step_rows(tmp_path)) == saved["step"] + 1


def _save(ckpt_dir, step, keep_last=None):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return save_checkpoint(ckpt_dir, step, model=model, optimizer=opt, scheduler=sched,
                           counters={"step": step},
                           resolved_config={}, keep_last=keep_last)


def test_corrupt_latest_falls_back_to_previous_with_warning(tmp_path):
    _save(tmp_path, 1)
    latest = _save(tmp_path, 2)
    latest.write_bytes(latest.read_bytes()[:100])  # a write cut short
    with pytest.warns(UserWarning, match="unreadable"):
        path, payload = load_latest_good(tmp_path)
    assert payload["step"] == 1 and path.name == "step_00000001.pt"
    with pytest.warns(UserWarning):
        assert find_checkpoint(str(tmp_path), experiment_name="x", search_roots=[])[1]["step"] == 1


def test_keep_last_prunes_and_leaves_no_temp_files(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004.pt", "step_00000005.pt"]
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_truncation_drops_later_rows_and_a_torn_last_line(tmp_path):
    """A run killed while writing a metrics row leaves half a line; resume used to fail on it."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "event": "start"}, {"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.25}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3, "rew')
    truncate_metrics(path, 1)
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:2]


def test_resume_refuses_foreign_payloads_and_other_models(tmp_path):
    """These used to end in KeyError: 'step' or a size-mismatch dump, deep inside the restore."""
    cfg = compose("grpo_tiny")
    (tmp_path / "metrics.jsonl").write_text("")
    in_run_dir = tmp_path / "checkpoints" / "step_00000001.pt"
    with pytest.raises(ResumeError, match=r"is not a checkpoint of this project \(it lacks \['step'"):
        check_resumable(in_run_dir, {"weights": 1}, cfg)
    payload = {key: {} for key in ("step", "model", "optimizer", "scheduler", "counters", "rng")}
    payload["config"] = {"model": {"name": "other/model"}, "train_model": {"lora": dict(cfg.train_model.lora)}}
    with pytest.raises(ResumeError, match=r"made with model.name='other/model', this run has .*tiny-model"):
        check_resumable(in_run_dir, payload, cfg)
    payload["config"]["model"]["name"] = cfg.model.name
    check_resumable(in_run_dir, payload, cfg)  # the same model, in a run dir: fine
    with pytest.raises(ResumeError, match=r"is not in a run dir's checkpoints/ folder"):
        check_resumable(tmp_path / "elsewhere" / "x.pt", payload, cfg)  # the run would write into its parent

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(ResumeError, match="do not fit this model"):
        restore_training_state({"model": torch.nn.Linear(3, 2).state_dict()}, model=model, optimizer=opt,
                               scheduler=sched)
