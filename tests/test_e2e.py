"""End-to-end runs of the scripts on the embedded tiny model, as a user would start them."""

import importlib.util
import json
import math
import statistics
import subprocess
import sys

import pytest

from conftest import REPO, TINY_DATA, TINY_MODEL, train_in_process
from grpo.tasks.data import PromptStream
from grpo.tasks.envs import load_gsm8k
from grpo.training.checkpoint import list_checkpoints

FAST = [f"model.name={TINY_MODEL}", f"env.dataset={TINY_DATA}", "logging.progress_bar=false"]


def grpo(run_dir, *overrides, config="grpo_tiny", script="grpo.py"):
    proc = subprocess.run(
        [sys.executable, str(REPO / "grpo" / script), "--config-name", config, f"hydra.run.dir={run_dir}", *overrides],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return proc, [r for r in rows if "reward" in r], [r for r in rows if "eval/accuracy" in r]


def test_tiny_sync_run_learns(tmp_path):
    proc, steps, evals = grpo(tmp_path, *FAST, "train.total_steps=10", "eval.frequency=0", "eval.num_problems=128")
    assert "every model on the CPU" in proc.stdout  # the device allocation, printed at start
    first, last = steps[:3], steps[-3:]
    assert sum(r["reward"] for r in last) / 3 > sum(r["reward"] for r in first) / 3 + 0.1
    assert [e["step"] for e in evals] == [0, 10]
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"]
    # each eval's per-problem scores; the accuracy's standard error, and the gain's paired one (same problems)
    scores = [json.loads(line) for line in (tmp_path / "eval_scores.jsonl").read_text().splitlines()]
    assert [s["step"] for s in scores] == [0, 10] and all(len(s["scores"]) == 128 for s in scores)
    for e, s in zip(evals, scores):
        assert e["eval/accuracy"] == pytest.approx(statistics.mean(s["scores"]))
        assert e["eval/accuracy_stderr"] == pytest.approx(statistics.stdev(s["scores"]) / math.sqrt(128))
    # each eval's greedy replies, a row a problem in problem order: its held-out question, the reply and its score
    replies = [json.loads(line) for line in (tmp_path / "eval_replies.jsonl").read_text().splitlines()]
    held_out = [json.loads(line) for line in (TINY_DATA / "test.jsonl").read_text().splitlines()]
    for s in scores:
        rows = [r for r in replies if r["step"] == s["step"]]
        assert [r["row"] for r in rows] == list(range(128)) and [r["score"] for r in rows] == s["scores"]
        assert all(held_out[r["row"]]["question"] in r["prompt"] and r["reply"].strip() for r in rows)
        # a reply scored right holds its problem's answer
        assert all(held_out[r["row"]]["answer"].split("#### ")[1] in r["reply"] for r in rows if r["score"] == 1)
    differences = [after - before for before, after in zip(scores[0]["scores"], scores[1]["scores"])]
    assert "eval/gain" not in evals[0] and evals[1]["eval/gain_since_step"] == 0
    assert evals[1]["eval/gain"] == pytest.approx(evals[1]["eval/accuracy"] - evals[0]["eval/accuracy"])
    assert evals[1]["eval/gain_stderr"] == pytest.approx(statistics.stdev(differences) / math.sqrt(128))
    assert "points since step 0 (same problems)" in proc.stdout + proc.stderr
    required = {"step", "reward", "advantage_std", "kl_to_ref", "kl_to_inference", "loss_objective", "clip_fraction",
                "ess", "entropy", "grad_norm", "response_length", "lr", "step_time_s"}
    assert required <= set(steps[0])
    # two epochs per batch: the second is off-policy, so ratios move away from 1
    assert any(r["ess"] < 1 for r in steps) and any(r["clip_fraction"] > 0 for r in steps)
    assert (tmp_path / "metrics.png").stat().st_size > 0
    assert list_checkpoints(tmp_path / "checkpoints")
    # step k trains stream batch k-1: the batch the env drew while it was built used to be skipped
    stream = PromptStream(len(load_gsm8k(str(TINY_DATA), "train")), seed=0)
    assert [r["prompt_indices"] for r in steps] == [sorted(set(stream.batch(k, 8))) for k in range(10)]


def test_tiny_ifeval_run_reports_ifeval_accuracies_and_wandb_logs_offline_without_api_key(tmp_path, monkeypatch):
    """One run, two claims: the IFEval task's evals report its accuracies, and ``logger=wandb`` with no API key
    (and no wandb.mode) writes an offline wandb run into the run dir rather than failing."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    _, steps, evals = grpo(tmp_path, f"model.name={TINY_MODEL}", "train.total_steps=2", "eval.num_problems=8",
                           "eval.batch_size=8", "logging.progress_bar=false", "logger=wandb", config="grpo_ifeval_tiny")
    assert len(steps) == 2
    for key in ("eval/prompt_strict_acc", "eval/inst_strict_acc", "eval/prompt_loose_acc", "eval/inst_loose_acc"):
        assert all(0 <= e[key] <= 1 for e in evals)
    assert [e["step"] for e in evals] == [0, 2]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and list(runs[0].glob("*.wandb"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (bash scripts/install_vllm_cpu.sh)")
def test_tiny_run_with_vllm_learns(tmp_path):
    # one optimiser step per batch: every loss is computed before that batch's update, so
    # kl_to_inference measures engine vs trainer weights alone, after every weight push
    _, steps, evals = grpo(tmp_path, *FAST, "inference_model.backend=vllm", "train.total_steps=8",
                           "train.epochs=1", "train.optim_batch_size=64", "eval.frequency=0", "eval.num_problems=64")
    # held-out accuracy, not the reward: 8 steps' rewards swing with their prompts' difficulty (0.39 -> 0.78 here)
    assert evals[-1]["eval/accuracy"] > evals[0]["eval/accuracy"] + 0.2
    assert all(r["kl_to_inference"] < 1e-3 for r in steps), [r["kl_to_inference"] for r in steps]
    assert all(abs(r["ess"] - 1) < 1e-2 for r in steps)
    assert all(r["weight_sync_s"] > 0 for r in steps)


VARIANTS = {"dr_grpo": ["train.loss_variant=dr_grpo"], "gspo": ["train.loss_variant=gspo"],
            "dapo": ["train.dynamic_sampling=true", "train.overlong_filter=true", "reward.overlong_buffer=8"]}


@pytest.mark.parametrize("config", ["grpo_tiny", "grpo_ifeval_tiny"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_trains_both_tiny_tasks(config, variant, tmp_path):
    """grpo/grpo.py's ``train`` run in this process (the loss variant is under test, not the launch, which the runs
    above cover): the ~10 s of imports a new process spends are this worker's, once."""
    train_in_process(tmp_path, ["logging.progress_bar=false", *VARIANTS[variant], "train.total_steps=2",
                                "eval.frequency=0", "eval.num_problems=16"], config_name=config)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert len(steps) == 2 and all(math.isfinite(r["loss_objective"]) for r in steps)
    # the first update, from the fresh model, has a gradient; after it the tiny model may have collapsed onto one reply
    # a prompt (entropy 0, seen with dr_grpo on grpo_ifeval_tiny), where a zero gradient is the right one
    assert steps[0]["grad_norm"] > 0 and all(r["grad_norm"] > 0 or r["entropy"] == 0 for r in steps)
    if variant == "dapo":  # however many collections a step drew, it trains 8 whole groups (64 / 8, 32 / 4)
        assert all(len(r["prompt_indices"]) == 8 and "filtered_groups" in r for r in steps)
