"""The async script's trainer ranks 1..N-1 as Ray actors (``train_model.num_devices=2``, on CPU over gloo): they train
as torchrun's ranks do, stop and checkpoint together on a signal, end with rank 0 however one of them dies, and a
local Ray too small for them is a one-line error (grpo/process/ray_placement.py)."""

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import SHORT_RUN
from grpo.process.errors import ConfigError
from grpo.process.ray_placement import check_room
from test_ranks import all_gone, assert_same_weights, command, run, session_processes, trained


def ray_own(cmdline: bytes) -> bool:
    """A local Ray's own process (GCS, raylet, monitors, node agents, idle workers): not the script or its actors."""
    return not (b"grpo/" in cmdline or cmdline.startswith((b"ray::TrainerRank", b"ray::RolloutWorker")))


# Every batch generated with the first weights and trained (no push, no lag limit): an async run is then the same
# from one launcher to another, value for value (with pushes, which version a batch got depends on timing).
ASYNC_EXACT = [*SHORT_RUN, "train.total_steps=4", "train.weight_update_frequency=1000", "train.max_policy_lag=1000",
               "ray.num_cpus=2"]


@pytest.fixture(scope="module")
def ray_actor_run(tmp_path_factory):
    """``grpo-async.py train_model.num_devices=2`` on a local Ray (rank 1 a Ray actor) of ``ASYNC_EXACT``: the process
    (finished, every process of its session gone), its steps and its export."""
    run_dir = tmp_path_factory.mktemp("ray")
    proc = run(run_dir, ASYNC_EXACT, ranks=2, torchrun=False, script="grpo-async.py")
    assert proc.returncode == 0 and all_gone(proc.session), "\n".join(
        [line for line in proc.stderr.splitlines() if "TrainerRank" in line or "Ray actor" in line][-20:]
        + [proc.stderr[-4000:]])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return proc, {r["step"]: r for r in rows if "reward" in r}, load_file(run_dir / "export" / "model.safetensors")


def assert_same_run(steps: dict, export: dict, expected_steps: dict, expected_export: dict) -> None:
    assert sorted(steps) == sorted(expected_steps) == [1, 2, 3, 4]
    for step, row in expected_steps.items():
        for key in ("reward", "prompt_indices", "loss_objective", "grad_norm", "kl_to_ref"):
            assert steps[step][key] == pytest.approx(row[key], rel=1e-6, abs=1e-9), (step, key)
    assert_same_weights(export, expected_export)


def test_the_async_script_s_other_ranks_are_ray_actors_that_train_as_torchrun_s(ray_actor_run, tmp_path):
    """``grpo-async.py train_model.num_devices=2``: rank 1 is a Ray actor, placed by Ray beside the rollout worker,
    and the run is the torchrun run's (rank 1 a process), metric for metric and weight for weight; no process of
    either run is left."""
    proc, ray_steps, ray_export = ray_actor_run
    assert "(TrainerRank pid=" in proc.stderr  # rank 1's output, as Ray forwards an actor's
    assert_same_run(ray_steps, ray_export, *trained(tmp_path, ASYNC_EXACT, ranks=2, script="grpo-async.py"))


def test_joining_a_cluster_rank_1_and_the_worker_run_on_another_node_and_train_as_on_a_local_ray(
        two_node_cluster, ray_actor_run, tmp_path):
    """``ray.address=<cluster>``: rank 1 and the rollout worker run on the cluster's other node (the head, rank 0's,
    offers no CPU), rank 1 joins rank 0's group at the address rank 0 publishes, the replies and weights cross
    nodes through Ray, and the run is the local Ray's, metric for metric and weight for weight. On CPU: where GPUs
    train, ranks span one node (docs/devices.md)."""
    local = [o for o in ASYNC_EXACT if not o.startswith("ray.num_cpus=")]  # a cluster's nodes declare their CPUs
    proc = run(tmp_path, [*local, f"ray.address={two_node_cluster}"], ranks=2, torchrun=False, script="grpo-async.py")
    assert proc.returncode == 0 and all_gone(proc.session), proc.stderr[-4000:]
    assert "Connected to Ray cluster" in proc.stderr and "(TrainerRank pid=" in proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    _, ray_steps, ray_export = ray_actor_run
    assert_same_run({r["step"]: r for r in rows if "reward" in r}, load_file(tmp_path / "export" / "model.safetensors"),
                    ray_steps, ray_export)


def ray_actor(session: int, name: str) -> int | None:
    """The pid of the session's Ray actor of class ``name`` (Ray titles its process ``ray::<class>[.<method>]``)."""
    for pid in session_processes(session):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(f"ray::{name}".encode()):
                return pid
    return None


def async_run_past_step_1(run_dir) -> subprocess.Popen:
    """A 2-rank async run (rank 1 a Ray actor) of 50 steps, in its own session, once it logged step 1."""
    proc = subprocess.Popen(command(run_dir, [*ASYNC_EXACT, "train.total_steps=50"], ranks=2, script="grpo-async.py",
                                    torchrun=False), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240  # a hang guard, not a timing
    while '"reward"' not in (metrics.read_text() if metrics.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is not None or time.monotonic() >= deadline:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the run ended or logged no step: {proc.communicate()[1][-4000:]}")
    return proc


@pytest.mark.parametrize("signalled", ["SIGTERM to rank 0", "Ctrl-C to the terminal's process group"])
def test_a_stopped_async_run_of_ray_actor_ranks_checkpoints_and_leaves_no_process(signalled, tmp_path):
    """SIGTERM to rank 0, or SIGINT to the whole process group as a terminal's Ctrl-C sends it (Ray's actors sit in
    process groups of their own, and the rank ignores it anyway): the step in progress ends, rank 1 gathers its
    shards into the checkpoint, and every process ends, with 128 + the signal."""
    proc = async_run_past_step_1(tmp_path)
    signum = signal.SIGTERM if signalled.startswith("SIGTERM") else signal.SIGINT
    try:
        os.kill(proc.pid, signum) if signum == signal.SIGTERM else os.killpg(proc.pid, signum)
        stdout, stderr = proc.communicate(timeout=240)
        assert all_gone(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, stderr[-4000:]
    stopped = re.search(r"^run stopped after step (\d+)", stdout, re.M)
    assert stopped and (tmp_path / "checkpoints" / f"step_{int(stopped[1]):08d}.json").exists(), stdout[-4000:]


@pytest.mark.parametrize("killed", ["rank 0", "rank 1"])
def test_a_killed_rank_ends_every_rank_and_ray_actor_of_an_async_run(killed, tmp_path):
    """kill -9 of rank 0 (Ray then ends the actors it owns) or of rank 1's actor (rank 0's next collective fails at
    once and it ends the run) once step 1 is logged: every process of the run ends, none waits out a timeout."""
    proc = async_run_past_step_1(tmp_path)
    victim = proc.pid if killed == "rank 0" else ray_actor(proc.pid, "TrainerRank")
    try:
        assert victim is not None, "no rank 1 actor"
        os.kill(victim, signal.SIGKILL)
        stderr = proc.communicate(timeout=120)[1]  # stdout, piped, is read too: a full pipe would block the run
        # the ranks and actors end within seconds; a local Ray's own processes (ray::DashboardAgent,
        # ray::RuntimeEnvAgent, the raylet) outlive a killed driver by 70 s, one rank or two (measured): Ray's to end
        assert all_gone(proc.pid, within=60, but=ray_own), [Path(f"/proc/{pid}/cmdline").read_bytes()[:40]
                                                            for pid in session_processes(proc.pid)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a process left behind (the test failed) goes too
    assert proc.returncode != 0, stderr[-4000:]
    if killed == "rank 1":  # rank 0's error is a closed connection; it names the rank and how its actor ended
        assert re.search(r"^rank 1 \(a Ray actor\) died: .*(unexpectedly|SIGKILL|killed)", stderr, re.M), stderr[-4000:]


def test_a_local_ray_too_small_for_the_async_run_s_actors_is_one_line():
    """Rank 1 on the CPU and 2 rollout workers take a CPU each: 2 CPUs would leave one waiting forever."""
    with pytest.raises(ConfigError, match=r"^ray.num_cpus=2 is too few for the run's Ray actors: 1 trainer rank\(s\) "
                                          r"and 2 rollout worker\(s\) \(train.num_collectors\), one CPU each. "
                                          r"Fix: ray.num_cpus=3 or ray.num_cpus=null \(all\)$"):
        check_room({"CPU": 2.0}, trainer_actors=1, workers=2, gpus=False)
    check_room({"CPU": 3.0}, trainer_actors=1, workers=2, gpus=False)
    check_room({"CPU": 2.0, "GPU": 3.0}, trainer_actors=1, workers=2, gpus=True)  # rank 1 takes a GPU, not a CPU
