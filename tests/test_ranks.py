"""The scripts as 2 data-parallel ranks on CPU (gloo), under torchrun or started by rank 0 itself
(``train_model.num_devices=2``): they train as 1 rank does, and as each other; resume after a kill -9 as a run
never stopped; stop together on a user error; and rank 0's followers end when it is killed."""

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from safetensors.torch import load_file

from conftest import REPO, SHORT_RUN, train_in_process
from grpo.process.devices import PlacementSettings, allocate_devices
from grpo.process.errors import DeviceAllocationError
from grpo.process.launch import agree_with_launcher, trainer_world
from grpo.process.world import World
from test_world import free_port

STEPS = [*SHORT_RUN, "train.total_steps=4", "train.checkpoint_frequency=2"]


def command(run_dir, overrides, ranks: int, script: str = "grpo.py", torchrun: bool = True) -> list[str]:
    """``python grpo/<script>`` alone, or as ``ranks`` ranks: torchrun's, or (``torchrun=False``) those
    ``train_model.num_devices`` has rank 0 start."""
    launcher, ranks_asked = [sys.executable], []
    if ranks > 1 and torchrun:
        launcher += ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", f"--master_port={free_port()}"]
    elif ranks > 1:
        ranks_asked = [f"train_model.num_devices={ranks}"]
    return [*launcher, str(REPO / "grpo" / script), "--config-name", "grpo_tiny", f"hydra.run.dir={run_dir}",
            *ranks_asked, *overrides]


def run(run_dir, overrides, ranks: int, timeout: int = 300, torchrun: bool = True,
        script: str = "grpo.py") -> SimpleNamespace:
    """The run's exit status, what it printed, and its session (its id: the first process's pid)."""
    with subprocess.Popen(command(run_dir, overrides, ranks, script, torchrun), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return SimpleNamespace(returncode=proc.returncode, stdout=stdout, stderr=stderr, session=proc.pid)


def session_processes(session: int) -> list[int]:
    """The live (not zombie) processes of a session: a run started in its own session and every process it started."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            state, _ppid, _group, sid = stat.read_text().rsplit(")", 1)[1].split()[:4]
            if int(sid) == session and state != "Z":
                pids.append(int(stat.parent.name))
    return pids


def all_gone(session: int, within: float = 60, but=lambda cmdline: False) -> bool:
    """Whether every process of the session ends (a process lives a moment after its files close), in ``within``
    seconds; ``but(cmdline)``: those left out of the count."""
    def left() -> list[int]:
        alive = []
        for pid in session_processes(session):
            with contextlib.suppress(OSError):
                if not but(Path(f"/proc/{pid}/cmdline").read_bytes()):
                    alive.append(pid)
        return alive

    deadline = time.monotonic() + within  # a hang guard, not a timing
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    return left() == []


def trained(run_dir, overrides, ranks: int, torchrun: bool = True, script: str = "grpo.py"):
    proc = run(run_dir, overrides, ranks, torchrun=torchrun, script=script)
    assert proc.returncode == 0 and all_gone(proc.session), proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward" in r}, load_file(run_dir / "export" / "model.safetensors")


def trained_here(run_dir, overrides):
    """``trained``'s one-rank run as grpo/grpo.py's train() in this process: the one-rank reference the multi-rank
    runs (new processes, whose launch is under test) are compared with."""
    train_in_process(run_dir, overrides)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward" in r}, load_file(run_dir / "export" / "model.safetensors")


def one_rank_steps(tmp_path_factory):
    """``trained_here``'s run of ``STEPS`` and its run dir, trained once for the whole test session: this file's
    reference and test_rank_generation.py's, the same run, which under xdist's workers found on the disk they share
    (the first to need it trains it, under a lock; the run dir is only read after). Tests must leave it as it is."""
    shared = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        shared = shared.parent  # the session's folder, above each worker's own
    run_dir, done = shared / "one-rank-steps", shared / "one-rank-steps.done"
    with open(shared / "one-rank-steps.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(run_dir, ignore_errors=True)  # a run of a worker that failed midway
            run_dir.mkdir()
            trained_here(run_dir, STEPS)
            done.touch()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward" in r}, load_file(run_dir / "export" / "model.safetensors"), run_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """4 steps from seed 0, checkpointed at step 2, on 1 rank (in-process, ``one_rank_steps``) and on 2 (torchrun):
    (steps' metrics, exported weights) each."""
    *one, one_dir = one_rank_steps(tmp_path_factory)
    runs = {1: one_dir, 2: tmp_path_factory.mktemp("ranks2")}
    return {1: tuple(one), 2: trained(runs[2], STEPS, 2)} | {"dirs": runs}


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


def test_num_devices_starts_the_ranks_torchrun_would(uninterrupted, tmp_path):
    """``python grpo/grpo.py train_model.num_devices=2``, no torchrun: rank 0 starts rank 1 itself, and the run
    is the torchrun run's, metric for metric and weight for weight; the followers are gone when it returns."""
    steps, export = trained(tmp_path, STEPS, ranks=2, torchrun=False)
    torchrun_steps, torchrun_export = uninterrupted[2]
    assert sorted(steps) == sorted(torchrun_steps) == [1, 2, 3, 4]
    for step, row in torchrun_steps.items():
        for key in ("reward", "prompt_indices", "loss_objective", "grad_norm", "kl_to_ref"):
            assert steps[step][key] == pytest.approx(row[key], rel=1e-6, abs=1e-9), (step, key)
    assert_same_weights(export, torchrun_export)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in uninterrupted["dirs"][2].iterdir())


def test_followers_end_when_rank_0_is_killed(tmp_path):
    """kill -9 of rank 0 alone, while rank 1 (which it started) still connects to it: rank 1 sees its parent gone
    and exits, rather than wait out the store's 30-minute timeout."""
    proc = subprocess.Popen(command(tmp_path, STEPS, ranks=2, torchrun=False), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60  # a hang guard, not a timing: rank 0 starts rank 1 within seconds
    while len(session_processes(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(session_processes(proc.pid)) == 2, "rank 0 started no follower"
    proc.kill()
    try:
        stderr = proc.communicate(timeout=120)[1]  # the pipe closes as every follower holding it exits
        assert all_gone(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a follower left behind (the test failed) goes too
    assert f"rank 1: rank 0 (pid {proc.pid}) is gone; exiting" in stderr, stderr[-4000:]


def test_a_follower_that_dies_before_joining_ends_rank_0(tmp_path):
    """Rank 0 waits for its followers to join, blocked in C++; one that exits first (a crash on import, say) would
    hold it until the 30-minute store timeout. Rank 0 names the rank, ends the others and exits."""
    (tmp_path / "fails.py").write_text("import sys\nsys.exit(3)\n")
    code = f"from grpo.process.launch import _followers\nwith _followers({str(tmp_path / 'fails.py')!r}, 3):\n    pass\n"
    with subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1 and all_gone(proc.pid)
    assert re.search(r"^error: rank [12] exited \(status 3\) before joining rank 0", stderr, re.M), stderr[-4000:]


def test_more_ranks_than_gpus_is_an_error_before_any_starts(monkeypatch):
    """The device check, which rank 0 runs before it starts any rank (a follower on no GPU would fail later)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = OmegaConf.create({"train_model": {"num_devices": 3, "devices": None}, "ref_model": {"colocate": True},
                            "inference_model": {"colocate": True}})
    with pytest.raises(DeviceAllocationError, match=r"^Not enough GPUs: train_model needs 3, but only 2 are unclaimed "
                                                    r"\(2 GPU\(s\) visible\). Fix: train_model.num_devices=2$"):
        placement = PlacementSettings.from_config(cfg)
        with trainer_world(placement, script="never started",
                           check=lambda: allocate_devices(placement, inference_engines=3, dedicated_inference=False)):
            pass


def kill_after_step_2_checkpoint(cmd: list[str], run_dir) -> None:
    """Run ``cmd`` (a 2-rank run into ``run_dir``) and kill -9 every process of it once the step-2 checkpoint is
    written, before the run's end."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    checkpoint, deadline = run_dir / "checkpoints" / "step_00000002.json", time.monotonic() + 240
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert checkpoint.exists() and not (run_dir / "export").exists()  # killed after the checkpoint, before the end

def test_a_two_rank_run_killed_after_a_checkpoint_resumes_to_the_same_weights(uninterrupted, tmp_path):
    """kill -9 of every rank (and torchrun) once the step-2 checkpoint is written; ``resume=`` on 2 ranks
    ends with the weights of the run that was never stopped."""
    kill_after_step_2_checkpoint(command(tmp_path, STEPS, ranks=2), tmp_path)
    steps, export = trained(tmp_path, [*STEPS, f"resume={tmp_path}"], ranks=2)
    assert sorted(steps) == [1, 2, 3, 4]
    assert_same_weights(export, uninterrupted[2][1])


NAN_LATE = """calls = 0
def nan_late(reply: str) -> float:
    global calls
    calls += 1
    return float("nan") if calls > 50 else 1.0
"""


@pytest.fixture
def followers_started(tmp_path, monkeypatch) -> Path:
    """A file each follower rank the runs of this test start (a Python process with RANK other than 0, or one that
    process starts) appends its rank to, as it starts: a ``sitecustomize`` first on the PYTHONPATH the runs inherit."""
    site, started = tmp_path / "site", tmp_path / "followers_started"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import os\nif os.environ.get('RANK', '0') != '0':\n"
                                           f"    with open({str(started)!r}, 'a') as f:\n"
                                           f"        f.write(os.environ['RANK'] + '\\n')\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    return started


@pytest.mark.parametrize("script", ["grpo.py", "grpo-async.py"])
def test_a_bad_config_value_on_two_ranks_fails_before_any_follower_starts(script, tmp_path, followers_started):
    """``train_model.num_devices=2`` with a bad value: rank 0 checks the config and devices before it starts rank 1,
    so it fails as one rank does, with the one line and status 2, and no follower ever started (none ran Python)."""
    cmd = command(tmp_path / "run", ["train.epochs=0"], ranks=2, script=script, torchrun=False)
    with subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 2 and all_gone(proc.pid)
    assert [line for line in stderr.splitlines() if line.startswith("error:")] == \
        ["error: train.epochs=0 must be >= 1."], stderr[-4000:]
    assert not followers_started.exists(), followers_started.read_text()


@pytest.mark.parametrize("when", ["start", "start_num_devices", "step_3", "async_start_num_devices", "async_step_3"])
def test_a_user_error_stops_every_rank_with_one_line(when, tmp_path, followers_started):
    """A user error once the ranks run: a bad config at start under torchrun, an empty data file (read after rank 0
    started its followers: processes, or the async script's Ray actors), or a reward function that returns NaN at
    step 3 (its 51st call: 5 eval replies, then 20 a step; async: in the rollout worker, 20 a batch): rank 0 prints
    the one line, and every rank (and Ray actor) exits, non-zero, within the timeout."""
    torchrun, script = when in ("start", "step_3"), "grpo-async.py" if when.startswith("async") else "grpo.py"
    when = when.removeprefix("async_")
    if when == "start":
        overrides, line = ["train.epochs=0"], "error: train.epochs=0 must be >= 1."
    elif when == "start_num_devices":
        (tmp_path / "empty.jsonl").touch()  # a missing one is refused on the command line, before any rank starts
        overrides, line = [f"env.dataset={tmp_path}/empty.jsonl"], f"error: env.dataset='{tmp_path}/empty.jsonl': "
    else:
        (tmp_path / "rewards.py").write_text(NAN_LATE)
        overrides = [*SHORT_RUN, "train.total_steps=5", "env.task=generic", "env.dataset=examples/my_task",
                     "env.prompt_key=question", "env.test_split=train", "eval.frequency=0", "env.num_envs=20",
                     "train.dialog_turns_per_batch=20", "train.optim_batch_size=10",
                     f"reward.functions=[{tmp_path}/rewards.py:nan_late]"]
        line = f"error: reward.functions[0]='{tmp_path}/rewards.py:nan_late' returned nan"
    if script == "grpo-async.py":
        overrides = [*overrides, "ray.num_cpus=2"]
    # 41-53 s; a timeout of 180 ran out once on a loaded machine
    proc = run(tmp_path / "run", overrides, ranks=2, timeout=300, torchrun=torchrun, script=script)
    assert proc.returncode != 0 and all_gone(proc.session)
    said = [text for text in proc.stderr.splitlines() if text.startswith("error:")]
    assert len(said) == 1 and said[0].startswith(line), proc.stderr[-4000:]
    if script == "grpo.py":  # a Ray actor gets its RANK after Python started, so the fixture cannot see it
        assert "1" in followers_started.read_text().split()  # the error reached a rank that ran
    if when == "step_3":  # the emergency checkpoint of step 2 gathered the weights over both ranks
        assert (tmp_path / "run" / "checkpoints" / "step_00000002.json").exists()


@pytest.mark.parametrize("asked,fix", [
    ("train_model.num_devices=3", "train_model.num_devices=2 (or null: torchrun's count) or --nproc_per_node=3"),
    ("train_model.devices=[0]", "train_model.devices=null (torchrun's count) or --nproc_per_node=1"),
])
def test_torchrun_and_the_config_must_agree_on_the_rank_count(asked, fix):
    """torchrun's 2 ranks: a config asking for another count is the one-line error naming both and the fix."""
    cfg = OmegaConf.create({"train_model": {"num_devices": None, "devices": None}})
    key, value = asked.split("=")
    OmegaConf.update(cfg, key, yaml.safe_load(value))
    with pytest.raises(DeviceAllocationError, match=rf"torchrun started 2 trainer rank\(s\) \(WORLD_SIZE=2\) but "
                                                    rf"{re.escape(asked)} asks for .*Fix: {re.escape(fix)}"):
        agree_with_launcher(PlacementSettings.from_config(cfg), World(rank=0, size=2))


def test_under_torchrun_a_null_rank_count_is_torchrun_s():
    cfg = OmegaConf.create({"train_model": {"num_devices": None, "devices": None}})
    # what the run's config and device allocation then say (hydra_main writes it)
    assert agree_with_launcher(PlacementSettings.from_config(cfg), World(rank=0, size=2)) == 2


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
