"""A run that crashes keeps its finished steps: a checkpoint of the last step whose update finished, if
the weights are whole, and one line saying where it is; then the exception goes on."""

import importlib.util
import signal
import sys

import pytest
import torch

from conftest import REPO, compose_in_run_dir
from grpo.rollout import local_rollouts
from grpo.training import checkpoint
from grpo.training.checkpoint import list_checkpoints, load_checkpoint
from grpo.training.step import GRPOStep
from test_checkpoint import SMALL, _same, step_rows


@pytest.fixture
def script(monkeypatch):
    """grpo/grpo.py, loaded in this process: what it does to sys.path and the signal handlers is undone."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    spec = importlib.util.spec_from_file_location("grpo_sync_script", REPO / "grpo" / "grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def train(script, run_dir, *overrides):
    """``python grpo/grpo.py --config-name grpo_tiny hydra.run.dir=<run_dir> <SMALL> <overrides>``."""
    cfg = compose_in_run_dir(run_dir, [*SMALL, *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    return script.train(cfg)


def fail_generating(monkeypatch, script, batch: int) -> None:
    """The collector raises once it has generated its ``batch``-th batch, as a sampler error would."""
    make_collector = local_rollouts.make_collector

    def make(env, policy, frames):
        collector = make_collector(env, policy, frames)
        batches = type(collector).__iter__

        def failing(self):
            for n, rollouts in enumerate(batches(self), start=1):
                if n == batch:
                    raise RuntimeError("generation failed")
                yield rollouts

        collector.__class__ = type("FailingCollector", (type(collector),), {"__iter__": failing})
        return collector

    monkeypatch.setattr(local_rollouts, "make_collector", make)  # where the script's source builds its collector


def checkpoint_names(run_dir):
    return [p.name for p in list_checkpoints(run_dir / "checkpoints")]


def test_a_crash_in_generation_keeps_the_finished_steps_as_a_periodic_checkpoint_would(script, tmp_path, monkeypatch,
                                                                                       capsys):
    periodic = tmp_path / "periodic"
    train(script, periodic, "train.total_steps=4", "train.checkpoint_frequency=2")
    crashed = tmp_path / "crashed"
    with monkeypatch.context() as patch:
        fail_generating(patch, script, batch=3)
        with pytest.raises(RuntimeError, match="generation failed"):
            train(script, crashed, "train.total_steps=4")  # checkpoint_frequency=0: only the final one was due
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == (f"step 3 failed (RuntimeError); emergency checkpoint of step 2: {crashed}/checkpoints/"
                    f"step_00000002.json (resume={crashed} continues from it)")
    assert checkpoint_names(crashed) == ["step_00000002.json"]
    # the periodic checkpoint's training state, though step 3 had drawn prompts and sampled replies
    emergency = load_checkpoint(crashed / "checkpoints" / "step_00000002.json")
    at_step_2 = load_checkpoint(periodic / "checkpoints" / "step_00000002.json")
    assert emergency["counters"] == at_step_2["counters"] == {"step": 2, "policy_version": 8, "last_eval_step": 0}
    for key in ("model", "optimizer", "scheduler", "rng"):
        assert _same(emergency[key], at_step_2[key]), key

    # and it resumes as the periodic one does, prompts included (test_checkpoint.py: that is as a run never stopped)
    from_emergency = train(script, tmp_path / "again", "train.total_steps=4", f"resume={crashed}")
    from_periodic = train(script, tmp_path / "again2", "train.total_steps=4",
                          f"resume={periodic}/checkpoints/step_00000002.json")
    a, b = step_rows(periodic), step_rows(crashed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for step in range(1, 5):
        assert a[step]["prompt_indices"] == b[step]["prompt_indices"] and a[step]["reward"] == b[step]["reward"]
    for p, q in zip(from_periodic.trainer.policy_model.parameters(), from_emergency.trainer.policy_model.parameters()):
        assert torch.equal(p, q)


def test_a_crash_inside_the_update_writes_no_checkpoint_and_says_so(script, tmp_path, monkeypatch, capsys):
    optimize, calls = GRPOStep.optimize, []

    def schedule_fails():
        raise RuntimeError("schedule failed")

    def optimize_then_fail(self, batch):
        calls.append(batch)
        if len(calls) == 3:  # step 3: its first optimiser step runs, then the schedule's step fails
            self.scheduler.step = schedule_fails
        return optimize(self, batch)

    monkeypatch.setattr(GRPOStep, "optimize", optimize_then_fail)
    with pytest.raises(RuntimeError, match="schedule failed"):
        train(script, tmp_path, "train.total_steps=4", "train.checkpoint_frequency=2")
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == (f"step 3 failed (RuntimeError) inside the optimiser update: no emergency checkpoint of "
                    f"half-updated weights; the last checkpoint is {tmp_path}/checkpoints/step_00000002.json "
                    f"(resume={tmp_path})")
    assert checkpoint_names(tmp_path) == ["step_00000002.json"]  # the regular one, untouched


def test_non_finite_weights_are_not_checkpointed(script, tmp_path, monkeypatch, capsys):
    optimize = GRPOStep.optimize

    def optimize_to_nan(self, batch):
        metrics = optimize(self, batch)
        next(self.policy.parameters()).data.fill_(float("nan"))  # a diverged update
        return metrics

    monkeypatch.setattr(GRPOStep, "optimize", optimize_to_nan)
    fail_generating(monkeypatch, script, batch=2)  # if sampling from NaN logits has not failed already
    with pytest.raises(RuntimeError):
        train(script, tmp_path, "train.total_steps=2")
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == ("step 2 failed (RuntimeError) with non-finite weights: no emergency checkpoint; this run has no "
                    "checkpoint")
    assert checkpoint_names(tmp_path) == []


def test_a_failing_emergency_save_does_not_hide_the_error(script, tmp_path, monkeypatch, capsys):
    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(checkpoint, "save_checkpoint", disk_full)
    fail_generating(monkeypatch, script, batch=2)
    with pytest.raises(RuntimeError, match="generation failed"):
        train(script, tmp_path, "train.total_steps=2")
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said == ("step 2 failed (RuntimeError); so did its emergency checkpoint (OSError: No space left on "
                    "device); this run has no checkpoint")
