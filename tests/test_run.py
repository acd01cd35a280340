"""grpo/loop/run.py: the run both scripts share, driven as the async script drives it."""

import hashlib
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

from conftest import SHORT_RUN, compose_in_run_dir, sync_script
from grpo.loop.logger import read_metrics
from grpo.loop.run import start_run
from grpo.rollout import local_rollouts
from grpo.tasks.envs import make_collector, make_env
from grpo.training.checkpoint import load_checkpoint
from grpo.training.replies import Replies


@pytest.fixture
def async_run(tmp_path, tiny_model_dir, tiny_data_dir):
    """A run as grpo-async.py starts it (dedicated inference: its own engine only evaluates), asked for the vLLM
    backend, which its workers run: this engine is our decode loop over the policy's own weights all the same."""
    cfg = compose_in_run_dir(tmp_path, [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}", "logger=none",
                                "logging.progress_bar=false", "inference_model.backend=vllm", "env.repeats=4",
                                "env.num_envs=8", "train.dialog_turns_per_batch=8", "train.optim_batch_size=4",
                                "train.gradient_accumulation_steps=1", "train.epochs=1", "eval.num_problems=8", "eval.batch_size=8"])
    run = start_run(cfg, inference_engines=1, dedicated_inference=True)
    yield run
    run.engine.shutdown()
    run.records.logger.close()


def test_policy_version_counts_optimiser_steps_and_eval_sees_them(async_run):
    run = async_run
    env = make_env(run.task, run.tokenizer, split="train", repeats=4, num_envs=8)
    metrics = run.train_on(Replies.from_collector(next(iter(make_collector(env, run.engine.policy, 8)))))
    # 8 replies in minibatches of 4, one epoch: two optimiser steps, whatever the script
    assert metrics["optim_steps"] == 2 and run.trainer.policy_version == metrics["policy_version"] == 2
    # the engine that evaluates got no push from the training loop (the workers did): eval pushes first
    assert type(run.engine).__name__ == "TransformersInference" and run.engine.version == 0
    run.evaluate_if_due(force=True)
    assert run.engine.version == run.trainer.policy_version == 2


def files_and_hashes(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_a_finished_run_ends_with_its_summary(finished_tiny_run):
    run_dir = finished_tiny_run.run_dir
    (step0, first, _), (step2, last, row) = [(r["step"], r["eval/accuracy"], r)
                                             for r in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in r]
    best_step, best_accuracy = (2, last) if last > first else (0, first)
    best, best_path = f"{best_accuracy:.3f} (step {best_step})", run_dir / "best" / f"step_{best_step:08d}.json"
    gain = f"{100 * row['eval/gain']:+.1f} ± {100 * row['eval/gain_stderr']:.1f} points since step 0"
    checkpoint = run_dir / "checkpoints" / "step_00000002.json"
    assert (step0, step2) == (0, 2)
    assert finished_tiny_run.stdout.endswith("\n".join([
        f"run finished: {run_dir}",
        f"  eval accuracy  first {first:.3f} (step 0) -> best {best} -> last {last:.3f} (step 2): {gain}",
        f"  metrics        {run_dir / 'metrics.jsonl'}, {run_dir / 'metrics.png'}",
        f"  eval replies   {run_dir / 'eval_replies.jsonl'}",
        f"  checkpoint     {checkpoint} (resume={run_dir} continues from it)",
        f"  best           {best_path} (accuracy {best_accuracy:.3f}; python -m grpo.export {best_path} <out> exports it)",
        f"  export         {run_dir / 'export'} (transformers' from_pretrained and vllm serve load it)",
    ]) + "\n"), finished_tiny_run.stdout[-2000:]
    assert (run_dir / "metrics.png").is_file() and checkpoint.is_file() and (run_dir / "export" / "config.json").is_file()


def test_a_stopped_run_ends_with_its_summary(tmp_path, capsys, monkeypatch):
    """SIGTERM after the first batch: the step finishes, a checkpoint is written, the summary says where."""
    with sync_script() as script:
        make_collector = local_rollouts.make_collector

        def terminated_after_one_batch(env, policy, frames):
            collector = make_collector(env, policy, frames)
            batches = type(collector).__iter__

            def batches_then_sigterm(self):
                for rollouts in batches(self):
                    os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler preempting the job would
                    yield rollouts

            collector.__class__ = type("Preempted", (type(collector),), {"__iter__": batches_then_sigterm})
            return collector

        monkeypatch.setattr(local_rollouts, "make_collector", terminated_after_one_batch)  # the script's source's
        with pytest.raises(SystemExit) as stopped:
            script.train(compose_in_run_dir(tmp_path, [*SHORT_RUN, "train.total_steps=5"]))
    assert stopped.value.code == 128 + signal.SIGTERM
    checkpoint = tmp_path / "checkpoints" / "step_00000001.json"
    accuracy = [r["eval/accuracy"] for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/accuracy" in r]
    best = tmp_path / "best" / "step_00000000.json"
    assert capsys.readouterr().out.endswith("\n".join([
        f"run stopped after step 1 (received SIGTERM): {tmp_path}",
        f"  eval accuracy  first {accuracy[0]:.3f} (step 0) -> best {accuracy[0]:.3f} (step 0) -> last "
        f"{accuracy[0]:.3f} (step 0)",
        f"  metrics        {tmp_path / 'metrics.jsonl'}, {tmp_path / 'metrics.png'}",
        f"  eval replies   {tmp_path / 'eval_replies.jsonl'}",
        f"  checkpoint     {checkpoint} (resume={tmp_path} continues from it)",
        f"  best           {best} (accuracy {accuracy[0]:.3f}; python -m grpo.export {best} <out> exports it)",
        f"  export         none (python -m grpo.export {checkpoint} <out> writes one)",
    ]) + "\n")
    assert len(accuracy) == 1 and checkpoint.is_file() and not (tmp_path / "export").exists()


def test_total_steps_0_evaluates_a_checkpoint_and_writes_nothing_else(finished_tiny_run, tmp_path):
    trained_dir = finished_tiny_run.run_dir
    before = {name: files_and_hashes(trained_dir / name) for name in ("checkpoints", "export")}
    trained_metrics = (trained_dir / "metrics.jsonl").read_text()
    saved = load_checkpoint(trained_dir / "checkpoints" / "step_00000002.json")
    with sync_script() as script:
        run = script.train(compose_in_run_dir(tmp_path, [*SHORT_RUN, "train.total_steps=0", f"resume={trained_dir}"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r.get("event") for r in rows] == ["eval_only", None] and [r["step"] for r in rows] == [2, 2]
    # the weights it resumed, evaluated as the trained run evaluated them at its end
    trained_eval = [r for r in read_metrics(trained_dir / "metrics.jsonl") if "eval/accuracy" in r][-1]
    assert rows[1]["eval/accuracy"] == trained_eval["eval/accuracy"]
    assert run.trainer.policy_version == saved["counters"]["policy_version"]  # no optimiser step
    weights = run.trainer.policy_model.state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in saved["model"].items())
    # nothing written: no checkpoint or export here, the trained run untouched
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "export").exists()
    assert {name: files_and_hashes(trained_dir / name) for name in before} == before
    assert (trained_dir / "metrics.jsonl").read_text() == trained_metrics


def test_total_steps_0_evaluates_model_name(tmp_path, tiny_model_dir):
    with sync_script() as script:
        run = script.train(compose_in_run_dir(tmp_path, [*SHORT_RUN, "train.total_steps=0"]))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r.get("event") for r in rows] == ["eval_only", None] and [r["step"] for r in rows] == [0, 0]
    assert 0 <= rows[1]["eval/accuracy"] <= 1 and rows[1]["eval/num_problems"] == 16
    assert run.trainer.policy_version == 0 and run.records.last_checkpoint is None
    original = load_file(tiny_model_dir / "model.safetensors")
    weights = run.trainer.policy_model.state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in original.items())
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "export").exists()


def test_max_minutes_ends_the_run_as_finished_and_a_resume_counts_the_minutes_already_trained(tmp_path):
    """train.max_minutes: the run ends once its steps have taken that long (6 ms here: after the first step), with the
    last step evaluated, checkpointed and exported; a resumed run counts the steps trained before it."""
    from conftest import train_in_process

    run_dir = tmp_path / "run"
    run = train_in_process(run_dir, [*SHORT_RUN, "train.total_steps=4", "train.max_minutes=0.0001"])
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert (run.step, run.out_of_minutes) == (1, True)
    assert [r["step"] for r in rows if "step_time_s" in r] == [1]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1]  # eval.frequency=0: the start and the last step
    assert (run_dir / "checkpoints" / "step_00000001.json").is_file() and (run_dir / "export" / "config.json").is_file()

    again = train_in_process(tmp_path / "again", [*SHORT_RUN, "train.total_steps=4", "train.max_minutes=0.0001",
                                                  f"resume={run_dir}"])
    assert (again.step, again.out_of_minutes) == (1, True)  # its minutes were spent before the resume
    longer = train_in_process(tmp_path / "longer", [*SHORT_RUN, "train.total_steps=4", "train.max_minutes=null",
                                                    f"resume={run_dir}"])
    assert (longer.step, longer.out_of_minutes) == (4, False)
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "step_time_s" in r] == [1, 2, 3, 4]
