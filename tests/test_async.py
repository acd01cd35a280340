"""Async GRPO: bounded staleness, weights reaching the workers, and a crashed worker ending the run."""

import json
import os
import signal
import subprocess
import sys
import time


from conftest import REPO, TINY_DATA, TINY_MODEL

SMALL = [f"model.name={TINY_MODEL}", f"env.dataset={TINY_DATA}", "eval.num_problems=16", "eval.batch_size=16", "eval.frequency=0", "env.num_envs=16", "env.repeats=4",
         "train.dialog_turns_per_batch=16", "train.optim_batch_size=16", "train.epochs=1",
         "inference_model.max_new_tokens=16", "ray.num_cpus=2"]


def run_async(tmp_path, overrides, timeout=400):
    return subprocess.run(
        [sys.executable, str(REPO / "grpo" / "grpo-async.py"), "--config-name", "grpo_tiny",
         f"hydra.run.dir={tmp_path}", *SMALL, *overrides],
        capture_output=True, text=True, timeout=timeout,
    )


def step_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r]


def test_no_trained_batch_exceeds_max_policy_lag_and_weights_reach_workers(tmp_path):
    # Weights move every optimiser step and no lag is allowed: batches queued before a push
    # must be dropped, and the workers must see every new version to produce usable data.
    proc = run_async(tmp_path, ["train.total_steps=6", "train.weight_update_frequency=1", "train.max_policy_lag=0",
                                "train.buffer_size=3", "train.inference_is_cap=2.0"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = step_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["policy_lag_max"] <= 0 for r in rows)
    assert rows[-1]["dropped_stale_batches"] > 0
    assert sum(r["gen_samples_per_s"] for r in rows) > 0 and all(r["train_samples_per_s"] > 0 for r in rows)
    versions = [r["collector_version_min"] for r in rows]
    assert versions == sorted(versions) and versions[-1] >= 4, versions
    # each push is checked on the worker: its generating model holds exactly the trainer's weights
    assert rows[-1]["weight_pushes_verified"] >= 4 and rows[-1]["weight_pushes_mismatched"] == 0
    # truncated IS ran: token weights are logged and none exceeds the cap
    assert all(0 < r["is_weight_mean"] <= 2.0 for r in rows)


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether ``pid`` is in ``ancestor``'s process tree (only this run's workers get killed)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def start_long_run(tmp_path) -> tuple[subprocess.Popen, list[str]]:
    """A long async run, once it has logged a training step, and its rollout workers' pids."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "grpo" / "grpo-async.py"), "--config-name", "grpo_tiny",
         f"hydra.run.dir={tmp_path}", *SMALL, "train.total_steps=1000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not ((tmp_path / "metrics.jsonl").exists() and step_rows(tmp_path)):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(1)
        assert step_rows(tmp_path), "the run never logged a training step"
        workers = [pid for pid in subprocess.run(["pgrep", "-f", "RolloutWorker"], capture_output=True,
                                                 text=True).stdout.split() if descends_from(int(pid), proc.pid)]
        assert workers, "no rollout worker process of this run found"
    except BaseException:
        proc.kill()
        raise
    return proc, workers


def test_killed_worker_stops_the_run_with_its_error(tmp_path):
    proc, pids = start_long_run(tmp_path)
    try:
        killed_at = time.time()
        for pid in pids:
            os.kill(int(pid), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
        assert time.time() - killed_at < 120
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert "rollout worker 0 failed" in stderr, stderr[-3000:]


def test_sigterm_finishes_the_step_checkpoints_and_stops_the_workers(tmp_path):
    """ray.init replaced the SIGTERM handler: the run aborted with SIGABRT and no checkpoint."""
    proc, workers = start_long_run(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    checkpoints = sorted((tmp_path / "checkpoints").glob("step_*.pt"))
    assert checkpoints and int(checkpoints[-1].stem.split("_")[1]) == step_rows(tmp_path)[-1]["step"]
    assert workers and not any(os.path.exists(f"/proc/{pid}") for pid in workers)
