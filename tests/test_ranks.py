"""The sync script under torchrun: 2 data-parallel ranks on CPU (gloo) train as 1 rank does, resume after a
kill -9 as a run never stopped, and stop together on a user error."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, SHORT_RUN
from test_world import free_port

STEPS = [*SHORT_RUN, "train.total_steps=4", "train.checkpoint_frequency=2"]


def command(run_dir, overrides, ranks: int, script: str = "grpo.py") -> list[str]:
    """``python grpo/<script>`` alone, or under torchrun as ``ranks`` ranks."""
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                     f"--nproc_per_node={ranks}", f"--master_port={free_port()}"]
    return [*launcher, str(REPO / "grpo" / script), "--config-name", "grpo_tiny", f"hydra.run.dir={run_dir}",
            *overrides]


def run(run_dir, overrides, ranks: int, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(command(run_dir, overrides, ranks), capture_output=True, text=True, timeout=timeout)


def trained(run_dir, overrides, ranks: int):
    proc = run(run_dir, overrides, ranks)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward" in r}, load_file(run_dir / "export" / "model.safetensors")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """4 steps from seed 0, checkpointed at step 2, on 1 rank and on 2: (steps' metrics, exported weights) each."""
    runs = {ranks: tmp_path_factory.mktemp(f"ranks{ranks}") for ranks in (1, 2)}
    return {ranks: trained(run_dir, STEPS, ranks) for ranks, run_dir in runs.items()} | {"dirs": runs}


def assert_same_weights(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, weight in expected.items():
        torch.testing.assert_close(got[name], weight, atol=1e-5, rtol=1e-5, msg=name)


def test_two_ranks_train_as_one(uninterrupted):
    """Rank 0 generates as a lone rank does (same seed, same weights to float error): the same rewards, step 1's
    loss and gradient norm to 1e-5 (later steps' to 1e-4), the same exported weights; and rank 1 wrote nothing."""
    (one, one_export), (two, two_export) = uninterrupted[1], uninterrupted[2]
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step, row in one.items():
        assert two[step]["reward"] == row["reward"] and two[step]["prompt_indices"] == row["prompt_indices"], step
        for key in ("loss_objective", "grad_norm", "kl_to_ref"):  # later steps start from weights equal to 1e-6
            assert two[step][key] == pytest.approx(row[key], rel=1e-5 if step == 1 else 1e-4, abs=1e-8), (step, key)
    assert_same_weights(two_export, one_export)
    dirs = uninterrupted["dirs"]
    assert sorted(p.name for p in dirs[2].iterdir()) == sorted(p.name for p in dirs[1].iterdir())


def test_a_two_rank_run_killed_after_a_checkpoint_resumes_to_the_same_weights(uninterrupted, tmp_path):
    """kill -9 of every rank (and torchrun) once the step-2 checkpoint is written; ``resume=`` on 2 ranks
    ends with the weights of the run that was never stopped."""
    proc = subprocess.Popen(command(tmp_path, STEPS, ranks=2), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    checkpoint, deadline = tmp_path / "checkpoints" / "step_00000002.json", time.monotonic() + 240
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert checkpoint.exists() and not (tmp_path / "export").exists()  # killed after the checkpoint, before the end
    steps, export = trained(tmp_path, [*STEPS, f"resume={tmp_path}"], ranks=2)
    assert sorted(steps) == [1, 2, 3, 4]
    assert_same_weights(export, uninterrupted[2][1])


NAN_LATE = """calls = 0
def nan_late(reply: str) -> float:
    global calls
    calls += 1
    return float("nan") if calls > 50 else 1.0
"""


@pytest.mark.parametrize("when", ["start", "step_3"])
def test_a_user_error_stops_every_rank_with_one_line(when, tmp_path):
    """A bad config at start, or a reward function that returns NaN at step 3 (its 51st call: 5 eval replies,
    then 20 a step): rank 0 prints the one line, and every rank exits, non-zero, within the timeout."""
    if when == "start":
        overrides, line = ["train.epochs=0"], "error: train.epochs=0 must be >= 1."
    else:
        (tmp_path / "rewards.py").write_text(NAN_LATE)
        overrides = [*SHORT_RUN, "train.total_steps=5", "env.task=generic", "env.dataset=examples/my_task",
                     "env.prompt_key=question", "env.test_split=train", "eval.frequency=0", "env.num_envs=20",
                     "train.dialog_turns_per_batch=20", "train.optim_batch_size=10",
                     f"reward.functions=[{tmp_path}/rewards.py:nan_late]"]
        line = f"error: reward.functions[0]='{tmp_path}/rewards.py:nan_late' returned nan"
    proc = run(tmp_path / "run", overrides, ranks=2, timeout=120)
    assert proc.returncode != 0
    said = [text for text in proc.stderr.splitlines() if text.startswith("error:")]
    assert len(said) == 1 and said[0].startswith(line), proc.stderr[-4000:]
    if when == "step_3":  # the emergency checkpoint of step 2 gathered the weights over both ranks
        assert (tmp_path / "run" / "checkpoints" / "step_00000002.json").exists()


def test_the_async_script_trains_on_two_ranks(tmp_path):
    """grpo-async.py under torchrun: rank 0 runs the Ray rollout worker and hands each batch to both ranks; every
    push sends the weights gathered whole from the sharded policy, and the worker's engine, read back, holds
    exactly them (none mismatched)."""
    # one-step off-policy: each batch is generated after the trainer took the last one, so pushes land in between
    proc = subprocess.run(command(tmp_path, [*SHORT_RUN, "train.total_steps=4", "train.buffer_size=0",
                                             "train.weight_update_frequency=1", "ray.num_cpus=2"],
                                  ranks=2, script="grpo-async.py"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    # the worker's first weights, then at least one push from the sharded policy, each read back exactly
    assert steps[-1]["weight_pushes_verified"] >= 2 and steps[-1]["weight_pushes_mismatched"] == 0, steps[-1]
    assert (tmp_path / "export" / "model.safetensors").exists()
