"""Checkpoints restore the same state: resumed runs equal straight ones, kills lose nothing."""

import hashlib
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, TINY_DATA, TINY_MODEL
from conftest import compose, train_in_process
from grpo.loop.resume import check_resumable, find_checkpoint, truncate_metrics
from grpo.loop.settings import ResumeSettings
from grpo.process.errors import ResumeError
from grpo.tasks.data import PromptStream
from grpo.tasks.envs import load_gsm8k
from grpo.training import checkpoint
from grpo.training.checkpoint import (list_checkpoints, load_checkpoint, load_latest_good, restore_training_state,
                                      save_checkpoint, training_state)

SMALL = [f"model.name={TINY_MODEL}", f"env.dataset={TINY_DATA}", "eval.num_problems=8", "eval.batch_size=8",
         "eval.frequency=0", "env.num_envs=16", "env.repeats=4", "train.dialog_turns_per_batch=16",
         "train.optim_batch_size=8", "train.epochs=2", "inference_model.max_new_tokens=16",
         "optimizer.warmup_steps=0", "logging.progress_bar=false"]
EXACT_KEYS = ["reward", "loss_objective", "grad_norm", "clip_fraction", "ess", "prompt_indices"]
# Averages of near-zero diagnostics (KL ~1e-14 at the start) can differ in the last bits between
# processes: CPU reductions take alignment-dependent vectorised paths. They must agree to 1e-6.
CLOSE_KEYS = ["kl_to_ref", "kl_to_inference", "entropy"]
# A run given a smaller train.total_steps has a cosine schedule of its own: runs resumed with a larger one
# continue a constant schedule
CONSTANT_LR = "optimizer.schedule=constant"


def grpo_cmd(run_dir, *overrides):
    return [sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-name", "grpo_tiny",
            f"hydra.run.dir={run_dir}", *SMALL, *overrides]


def run(run_dir, *overrides):
    proc = subprocess.run(grpo_cmd(run_dir, *overrides), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def train_here(run_dir, *overrides):
    """``run``'s run, trained in this process (grpo/grpo.py's train): for runs whose launch is not under test (the
    uninterrupted runs the resumed ones are compared with, and the first halves the resumes continue); each resume
    is a new process."""
    train_in_process(run_dir, [*SMALL, *overrides])


def step_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "reward" in r}


def final_weights(run_dir):
    return load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])["model"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    train_here(run_dir, "train.total_steps=4", CONSTANT_LR)
    return run_dir


def test_half_then_resume_equals_straight_run(straight, tmp_path):
    train_here(tmp_path, "train.total_steps=2", CONSTANT_LR)  # the resume, a new process, is under test
    run(tmp_path / "again", "train.total_steps=4", CONSTANT_LR, f"resume={tmp_path}")  # new hydra dir, continues tmp_path
    a, b = step_rows(straight), step_rows(tmp_path)
    assert sorted(b) == [1, 2, 3, 4]
    for step in range(1, 5):
        for key in EXACT_KEYS:
            assert a[step][key] == b[step][key], (step, key)  # bitwise on CPU
        for key in CLOSE_KEYS:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-6, abs=1e-9), (step, key)
    wa, wb = final_weights(straight), final_weights(tmp_path)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # the resumed run's last eval is paired with the first run's step 0, as the straight run's is
    assert [json.loads(line)["step"] for line in (tmp_path / "eval_scores.jsonl").read_text().splitlines()] == [0, 2, 4]
    assert [json.loads(line)["step"] for line in (tmp_path / "eval_replies.jsonl").read_text().splitlines()] == (
        [0] * 8 + [2] * 8 + [4] * 8)  # eval.num_problems=8
    (gain_a,), (gain_b,) = ([r for r in eval_rows(d) if r["step"] == 4] for d in (straight, tmp_path))
    assert gain_b["eval/gain_since_step"] == 0 and gain_b["eval/gain"] == gain_a["eval/gain"]
    assert gain_b["eval/gain_stderr"] == gain_a["eval/gain_stderr"]


def eval_rows(run_dir):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "eval/accuracy" in r]


@pytest.mark.parametrize("draw", [[], ["env.num_envs=32"]], ids=["step-sized draws", "draws twice a step"])
def test_dynamic_sampling_half_then_resume_equals_straight_run(tmp_path, draw):
    """A step may draw several collections; the resumed run must start after the last one drawn. A draw may also be
    one generation batch larger than the step (env.num_envs above train.dialog_turns_per_batch)."""
    dynamic = ["train.dynamic_sampling=true", "train.max_extra_generation_batches=2", CONSTANT_LR, *draw,
               "train.total_steps=4"]
    train_here(tmp_path / "straight", *dynamic)
    train_here(tmp_path / "half", *dynamic[:-1], "train.total_steps=2")
    run(tmp_path / "again", *dynamic, f"resume={tmp_path / 'half'}")
    a, b = step_rows(tmp_path / "straight"), step_rows(tmp_path / "half")
    assert sorted(b) == [1, 2, 3, 4]
    if draw:  # a draw is 8 prompts (the stream's next batch), a step trains 4 of them; one step drew twice
        stream = PromptStream(len(load_gsm8k(str(TINY_DATA), "train")), seed=0)
        extra = [a[step]["extra_generation_batches"] for step in range(1, 5)]
        assert sum(extra) > 0, "the test needs a step that drew twice"
        first = 0  # the stream batch a step draws first
        for step in range(1, 5):
            drawn = {i for k in range(first, first + 1 + extra[step - 1]) for i in stream.batch(k, 8)}
            assert len(a[step]["prompt_indices"]) == 4 and set(a[step]["prompt_indices"]) < drawn, step
            first += 1 + extra[step - 1]
    else:
        assert sum(a[step]["extra_generation_batches"] for step in (1, 2)) > 0, "the test needs extra draws before the resume"
    for step in range(1, 5):
        for key in EXACT_KEYS + ["extra_generation_batches", "filtered_groups"]:
            assert a[step][key] == b[step][key], (step, key)


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


def stop_after_a_step(proc, run_dir, stop, after: int = 0) -> dict:
    """Send ``stop`` once ``run_dir`` holds a step past ``after``; the run must finish that step, checkpoint it and
    exit with 128 + the signal. The checkpoint."""
    deadline = time.time() + 400
    while time.time() < deadline and not ((run_dir / "metrics.jsonl").exists() and max(step_rows(run_dir), default=0)
                                          > after):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    proc.send_signal(stop)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 128 + stop, stderr[-3000:]
    assert f"{stop.name}: finishing this step, then checkpointing" in stderr
    saved = load_checkpoint(list_checkpoints(run_dir / "checkpoints")[-1])
    assert saved["step"] == max(step_rows(run_dir)) < 50
    return saved


def test_sigterm_then_sighup_checkpoint_at_step_boundary_and_resume(tmp_path):
    """SIGTERM, then SIGHUP (the terminal or ssh session closed) to the run resumed from its checkpoint: each stop
    finishes the step, checkpoints it and exits with 128 + the signal, and the next resume goes on from it. (One
    chain where each signal had a run and a resume of its own.)"""
    popen = dict(stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    by_sigterm = stop_after_a_step(subprocess.Popen(grpo_cmd(tmp_path, "train.total_steps=50"), **popen), tmp_path,
                                   signal.SIGTERM)
    by_sighup = stop_after_a_step(subprocess.Popen(grpo_cmd(tmp_path / "again", "train.total_steps=50",
                                                            f"resume={tmp_path}"), **popen),
                                  tmp_path, signal.SIGHUP, after=by_sigterm["step"])
    assert by_sighup["step"] > by_sigterm["step"]
    # one step more than the stopped run made: its cosine schedule changes, which resume refuses unless told
    run(tmp_path / "again2", f"train.total_steps={by_sighup['step'] + 1}", "resume_allow_changes=true",
        f"resume={tmp_path}")
    assert max(step_rows(tmp_path)) == by_sighup["step"] + 1


def _trained(seed=0):
    """A model with a frozen part, after two AdamW steps: optimiser state and schedule are not trivial."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    for _ in range(2):
        model(torch.randn(5, 3)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    return model, opt, sched


def _save(ckpt_dir, step, keep_last=None, extra=None):
    model, opt, sched = _trained(step)
    return save_checkpoint(ckpt_dir, step, state=training_state(model, opt, sched), counters={"step": step},
                           resolved_config={}, extra=extra, keep_last=keep_last)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _draws():
    return random.random(), np.random.rand(), torch.rand(3).tolist(), np.random.randn()


def test_round_trip_restores_weights_optimizer_schedule_and_rng(tmp_path):
    model, opt, sched = _trained()
    np.random.randn()  # a cached Gaussian is part of numpy's state too
    path = save_checkpoint(tmp_path, 7, state=training_state(model, opt, sched), counters={"step": 7},
                           resolved_config={"seed": 1}, extra={"data_position": 3, "wandb_run_id": None})
    expected = _draws()
    assert path.name == "step_00000007.json" and sorted(p.suffix for p in tmp_path.iterdir()) == [".json",
                                                                                                ".safetensors"]

    fresh, fresh_opt, fresh_sched = _trained(seed=1)
    random.seed(5)
    np.random.seed(5)
    torch.manual_seed(5)
    payload = load_checkpoint(path)
    assert set(payload["model"]) == {"1.weight", "1.bias"}  # only what training changes
    assert payload["step"] == 7 and payload["data_position"] == 3 and payload["wandb_run_id"] is None
    restore_training_state(payload, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert _same(fresh[1].state_dict(), model[1].state_dict())
    assert _same(fresh_opt.state_dict(), opt.state_dict()) and _same(fresh_sched.state_dict(), sched.state_dict())
    assert _draws() == expected
    # and training goes on identically from there
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m[1].weight.sum().backward()
        o.step()
    assert _same(fresh[1].state_dict(), model[1].state_dict())


def test_extras_must_be_plain_json(tmp_path):
    with pytest.raises(TypeError, match="checkpoint extra 'shuttle' is not JSON-serialisable"):
        _save(tmp_path, 1, extra={"data_position": 2, "shuttle": torch.zeros(2)})
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_corrupt_latest_falls_back_to_previous_with_warning(tmp_path):
    _save(tmp_path, 1)
    latest = _save(tmp_path, 2)
    tensors = tmp_path / json.loads(latest.read_text())["tensors"]["file"]
    tensors.write_bytes(tensors.read_bytes()[:100])  # cut short
    torn = _save(tmp_path, 3)
    torn.write_text(torn.read_text()[:100])
    with pytest.warns(UserWarning, match="unreadable") as warned:
        path, payload = load_latest_good(tmp_path)
    assert "JSONDecodeError" in str(warned[0].message) and "sha256" in str(warned[1].message)
    assert payload["step"] == 1 and path.name == "step_00000001.json"
    with pytest.warns(UserWarning):
        assert find_checkpoint(str(tmp_path), experiment_name="x", search_roots=[])[1]["step"] == 1


def test_a_flipped_byte_in_tensor_data_is_detected(tmp_path):
    _save(tmp_path, 1)
    latest = _save(tmp_path, 2)
    tensors = tmp_path / json.loads(latest.read_text())["tensors"]["file"]
    data = bytearray(tensors.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor: the file still parses, and loads silently without a checksum
    tensors.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="does not match its sha256"):
        path, payload = load_latest_good(tmp_path)
    assert payload["step"] == 1
    with pytest.warns(UserWarning, match="does not match its sha256"):  # named explicitly: the older one, said so
        assert find_checkpoint(str(latest), experiment_name="x", search_roots=[])[1]["step"] == 1
    (tmp_path / "step_00000001.json").unlink()
    with pytest.raises(ResumeError, match=r"unreadable \(ValueError: .* does not match its sha256.*no older"):
        find_checkpoint(str(latest), experiment_name="x", search_roots=[])


def test_the_tensors_digest_is_the_sha256_of_their_blocks_sha256s(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "HASH_BLOCK", 1000)  # the tiny checkpoint spans several blocks, the last one short
    path = _save(tmp_path, 1)
    entry = json.loads(path.read_text())["tensors"]
    data = (tmp_path / entry["file"]).read_bytes()
    assert len(data) > 3 * 1000 and len(data) % 1000
    blocks = b"".join(hashlib.sha256(data[i:i + 1000]).digest() for i in range(0, len(data), 1000))
    assert entry["blocks_sha256"] == hashlib.sha256(blocks).hexdigest()
    assert entry["file"][14:30] == entry["blocks_sha256"][:16]  # the file named by its digest


def test_a_checkpoint_with_the_whole_file_sha256_of_earlier_versions_still_loads(tmp_path):
    path = _save(tmp_path, 1)
    record = json.loads(path.read_text())
    del record["tensors"]["blocks_sha256"]
    tensors = tmp_path / record["tensors"]["file"]
    record["tensors"]["sha256"] = hashlib.sha256(tensors.read_bytes()).hexdigest()
    path.write_text(json.dumps(record))
    assert _same(load_checkpoint(path)["model"], training_state(*_trained(1))["model"])
    record["tensors"]["sha256"] = hashlib.sha256(b"other bytes").hexdigest()
    path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="does not match its sha256"):
        load_checkpoint(path)


def test_non_finite_names_the_float_tensors_with_a_nan_or_an_inf():
    tensors = {"ok": torch.ones(3), "nan": torch.tensor([1.0, float("nan")]), "ints": torch.arange(3),
               "inf": torch.tensor([-float("inf")], dtype=torch.bfloat16), "also_ok": torch.zeros(2, 2)}
    assert checkpoint.non_finite(tensors) == ["nan", "inf"]
    assert checkpoint.non_finite({"ints": torch.arange(2)}) == [] and checkpoint.non_finite({}) == []


def test_torn_temp_writes_are_ignored_then_cleaned_up(tmp_path):
    _save(tmp_path, 1)
    # killed while writing step 2: temp files, and tensors renamed into place but never committed by their JSON
    (tmp_path / "step_00000002.safetensors.tmp").write_bytes(b"\x00" * 10)
    (tmp_path / "step_00000002.json.tmp").write_text('{"step": 2, "mod')
    (tmp_path / "step_00000002.0123456789abcdef.safetensors").write_bytes(b"\x00" * 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path, payload = load_latest_good(tmp_path)
    assert payload["step"] == 1 and list_checkpoints(tmp_path) == [path]
    _save(tmp_path, 3)
    assert sorted(p.name[:13] + p.suffix for p in tmp_path.iterdir()) == [
        "step_00000001.json", "step_00000001.safetensors", "step_00000003.json", "step_00000003.safetensors"]


@pytest.mark.parametrize("killed_at_rename", [0, 1, None])
def test_a_kill_at_any_rename_leaves_the_old_or_the_new_checkpoint(tmp_path, monkeypatch, killed_at_rename):
    """Saving a step that already has a checkpoint (the final save after a periodic one) included."""
    old_weights = load_checkpoint(_save(tmp_path, 2))["model"]
    renames, real_replace = [], os.replace

    def replace(src, dst):
        if len(renames) == killed_at_rename:
            raise KeyboardInterrupt("killed")
        renames.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    model, opt, sched = _trained(seed=9)
    try:
        save_checkpoint(tmp_path, 2, state=training_state(model, opt, sched), counters={"step": 2},
                        resolved_config={})
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, payload = load_latest_good(tmp_path)
    new_weights = {f"1.{k}": v for k, v in model[1].state_dict().items()}
    assert _same(payload["model"], new_weights if killed_at_rename is None else old_weights)


def test_keep_last_prunes_and_leaves_no_temp_files(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004.json", "step_00000005.json"]
    assert sorted(p.name[:13] for p in tmp_path.glob("*.safetensors")) == ["step_00000004", "step_00000005"]
    assert not list(tmp_path.glob("*.tmp"))


def test_committed_is_told_the_moment_the_json_is_in_place_before_the_pruning(tmp_path):
    """A run names its last checkpoint from this call: the one on disk, even to a Ctrl-C during the pruning."""
    for step in (1, 2):
        _save(tmp_path, step, keep_last=2)
    seen = []

    def committed(path):
        seen.append((path.name, [p.name for p in list_checkpoints(tmp_path)]))

    model, opt, sched = _trained(3)
    path = save_checkpoint(tmp_path, 3, state=training_state(model, opt, sched), counters={"step": 3},
                           resolved_config={}, keep_last=2, committed=committed)
    assert seen == [("step_00000003.json", ["step_00000001.json", "step_00000002.json", "step_00000003.json"])]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002.json", path.name]


class _Exploit:
    """What a crafted step_*.pt holds: unpickling it runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def test_a_crafted_pickle_is_never_loaded(tmp_path):
    """A step_*.pt used to be torch.load-ed with weights_only=False: this one ran its command on resume."""
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "victim"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    crafted = run_dir / "checkpoints" / "step_00000003.pt"
    torch.save({"step": 3, "model": _Exploit(marker)}, crafted)
    for resume in (crafted, run_dir):
        with pytest.raises(ResumeError, match=r"pickled checkpoints .* are not loaded: unpickling can run arbitrary"):
            find_checkpoint(str(resume), experiment_name="grpo-tiny", search_roots=[])
    # resume=auto over a folder planted under outputs/: a 2-line config, the pickle, and a JSON whose
    # "tensors" (with the right sha256) are that pickle again
    planted = tmp_path / "outputs" / "2099-01-01" / "00-00-00"
    (planted / ".hydra").mkdir(parents=True)
    (planted / ".hydra" / "config.yaml").write_text("logging:\n  experiment_name: grpo-tiny\n")
    (planted / "checkpoints").mkdir()
    (planted / "checkpoints" / "step_00000003.pt").write_bytes(crafted.read_bytes())
    disguised = planted / "checkpoints" / "step_00000004.0123456789abcdef.safetensors"
    disguised.write_bytes(crafted.read_bytes())
    (planted / "checkpoints" / "step_00000004.json").write_text(json.dumps({"step": 4, "tensors": {
        "file": disguised.name, "sha256": hashlib.sha256(disguised.read_bytes()).hexdigest()}}))
    with pytest.warns(UserWarning, match="unreadable"), pytest.raises(ResumeError, match="resume=auto: no run"):
        find_checkpoint("auto", experiment_name="grpo-tiny", search_roots=[tmp_path / "outputs"])
    assert not marker.exists()
    proc = subprocess.run(grpo_cmd(tmp_path / "new", f"resume={crafted}"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "pickled checkpoints" in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert not marker.exists()
    torch.load(crafted, weights_only=False)  # the old loader: the payload is live
    assert marker.exists()


def _planted_run(run_dir, experiment_name, overrides, step):
    """A run dir as Hydra and a run leave it: the config and overrides Hydra records, a checkpoint."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text(f"logging:\n  experiment_name: {experiment_name}\n")
    (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return _save(run_dir / "checkpoints", step)


def test_resume_auto_picks_the_run_with_the_same_overrides(tmp_path):
    """A sweep's jobs share an experiment_name: resume=auto used to take the latest checkpoint of any of them."""
    sweep = tmp_path / "multirun" / "2099-01-01" / "00-00-00"
    job0 = _planted_run(sweep / "0", "grpo-tiny", ["optimizer.lr=1e-4", "train.total_steps=4"], step=2)
    job1 = _planted_run(sweep / "1", "grpo-tiny", ["optimizer.lr=3e-4", "train.total_steps=4"], step=3)
    single = _planted_run(tmp_path / "outputs" / "2099-01-02" / "00-00-00", "grpo-tiny", [], step=5)
    other = _planted_run(tmp_path / "outputs" / "2099-01-03" / "00-00-00", "grpo-other", ["optimizer.lr=1e-4",
                                                                                           "train.total_steps=4"], step=6)
    now = time.time()
    for i, path in enumerate((job0, job1, single, other)):  # newest last: the single run is grpo-tiny's latest
        os.utime(path, (now + i, now + i))
    roots = [tmp_path / "outputs", tmp_path / "multirun"]

    def auto(overrides, name="grpo-tiny"):
        return find_checkpoint("auto", experiment_name=name, overrides=overrides, search_roots=roots)[0]

    # the same job of a new sweep (its job number may differ), the order of overrides and resume= aside
    assert auto(["train.total_steps=4", "optimizer.lr=3e-4", "resume=auto"]) == job1
    assert auto(["resume=auto", "optimizer.lr=1e-4", "train.total_steps=4"]) == job0
    assert auto(["resume=auto"]) == single
    assert auto(["optimizer.lr=1e-4", "train.total_steps=4"], name="grpo-other") == other
    with pytest.raises(ResumeError, match=r"resume=auto: no run of logging.experiment_name='grpo-tiny' with the "
                                          r"overrides \['optimizer.lr=1e-3'\]"):
        auto(["optimizer.lr=1e-3", "resume=auto"])


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

    def check(path, payload, cfg):  # as start_run calls it: the settings, and the resolved config compared
        check_resumable(path, payload, ResumeSettings.from_config(cfg), OmegaConf.to_container(cfg, resolve=True))

    (tmp_path / "metrics.jsonl").write_text("")
    in_run_dir = tmp_path / "checkpoints" / "step_00000001.json"
    with pytest.raises(ResumeError, match=r"is not a checkpoint of this project \(it lacks \['step'"):
        check(in_run_dir, {"weights": 1}, cfg)
    payload = {key: {} for key in ("step", "model", "optimizer", "scheduler", "counters", "rng")}
    payload["config"] = {"model": {"name": "other/model"}, "train_model": {"lora": dict(cfg.train_model.lora)}}
    with pytest.raises(ResumeError, match=r"made with model.name='other/model', this run has .*tiny-model"):
        check(in_run_dir, payload, cfg)
    payload["config"], payload["step"] = OmegaConf.to_container(cfg, resolve=True), 1
    check(in_run_dir, payload, cfg)  # the same model and run, in a run dir: fine
    payload["config"]["train"]["inference_is_cap"] = 2.0  # a checkpoint from before train.importance_sampling
    with pytest.raises(ResumeError, match=r"train.inference_is_cap=2.0, retired: pass "
                                          r"train.importance_sampling=token_truncate train.is_high=2.0 to go on"):
        check(in_run_dir, payload, cfg)
    now = compose("grpo_tiny", ["train.importance_sampling=token_truncate", "train.is_high=2.0"])
    check(in_run_dir, payload, now)
    with pytest.raises(ResumeError, match=r"is not in a run dir's checkpoints/ folder"):
        check(tmp_path / "elsewhere" / "step_00000001.json", payload, cfg)  # it would write into its parent

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(ResumeError, match="do not fit this model"):
        restore_training_state({"model": torch.nn.Linear(3, 2).state_dict()}, model=model, optimizer=opt,
                               scheduler=sched)
