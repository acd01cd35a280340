"""End-to-end runs with the sandboxed Python tool on the embedded tiny tool model (grpo_tools_tiny), as a user would
start them: sync learns to call the tool and answer; eval-only and resume read its checkpoint; async and the vLLM
engine run the same episodes."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, train_in_process

FAST = ["logging.progress_bar=false", "eval.frequency=0"]


def grpo(run_dir, *overrides, script="grpo.py"):
    proc = subprocess.run(
        [sys.executable, str(REPO / "grpo" / script), "--config-name", "grpo_tools_tiny", f"hydra.run.dir={run_dir}",
         *FAST, *overrides], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return proc, [r for r in rows if "reward" in r], [r for r in rows if "eval/accuracy" in r]


def evals_in_process(run_dir, *overrides) -> list[dict]:
    """``grpo``'s eval rows of a run trained in this process: for runs whose launch is not under test."""
    train_in_process(run_dir, [*FAST, *overrides], config_name="grpo_tools_tiny")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/accuracy" in r]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Four steps of the default tool run, held out on 64 problems before and after (at 4: accuracy 0.31, calls an
    episode 1.00, in training 0.27 -> 0.94; at 6: 0.375, 1.00; at 10: 0.42, 1.00)."""
    run_dir = tmp_path_factory.mktemp("tools") / "run"
    proc, steps, evals = grpo(run_dir, "train.total_steps=4", "eval.num_problems=64", "logging.samples_every=4")
    return run_dir, proc, steps, evals


def test_the_tiny_model_learns_to_call_the_tool_and_answer(trained):
    run_dir, proc, steps, evals = trained
    assert "sandbox: " in proc.stdout and "no network" in proc.stdout  # the protections line, once at start
    first, last = evals[0], evals[-1]
    assert first["eval/tool_calls_per_episode"] < 0.2 and first["eval/accuracy"] < 0.05  # greedy: no call, no answer
    assert last["eval/tool_calls_per_episode"] > 0.8 and last["eval/accuracy"] > first["eval/accuracy"] + 0.1
    assert steps[-1]["tools/calls_per_episode"] > steps[0]["tools/calls_per_episode"] + 0.3
    assert all(1.0 <= s["episode/turns"] <= 2.0 and 0 <= s["tools/error_rate"] <= 1 for s in steps)
    assert all(s["mismatch/kl"] < 1e-6 for s in steps)  # float32 sampler and trainer, tool turns masked
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert any("<tool_call>" in s["reply"] and "⟦env: " in s["reply"] for s in samples)


def test_eval_only_and_resume_read_the_trained_tool_policy(trained, tmp_path):
    run_dir, _, _, evals = trained
    again = evals_in_process(tmp_path / "eval", f"resume={run_dir}", "train.total_steps=0", "eval.num_problems=64")
    assert again[-1]["eval/accuracy"] == pytest.approx(evals[-1]["eval/accuracy"])
    assert again[-1]["eval/tool_calls_per_episode"] == pytest.approx(evals[-1]["eval/tool_calls_per_episode"])


def test_the_export_keeps_the_tool_template(trained):
    from transformers import AutoTokenizer

    from grpo.tasks.python_tool import PYTHON_TOOL

    run_dir, *_ = trained
    tok = AutoTokenizer.from_pretrained(run_dir / "export")
    text = tok.apply_chat_template([{"role": "user", "content": "q"}], tools=[PYTHON_TOOL], tokenize=False)
    assert '"name": "python"' in text


@pytest.mark.parametrize("script, overrides", [("grpo-async.py", []),
                                               ("grpo.py", ["inference_model.backend=vllm"])])
def test_async_and_vllm_run_tool_episodes(script, overrides, tmp_path):
    if "inference_model.backend=vllm" in overrides:
        pytest.importorskip("vllm")
    _, steps, _ = grpo(tmp_path, "train.total_steps=2", "eval.num_problems=16", *overrides, script=script)
    assert len(steps) == 2 and all(s["tools/calls_per_episode"] > 0 and s["episode/turns"] > 1 for s in steps)
