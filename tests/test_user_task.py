"""Your own task: ``env.task=generic`` over your data, ``reward.functions`` from your code, in the sync
and async scripts; the README's example, run as written, learns. Bad functions and data: test_bad_inputs."""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
from torchrl.data.llm import History

from conftest import REPO, TINY_DATA, TINY_MODEL, compose, train_in_process
from grpo.inference.decoding import ReplySampler
from grpo.inference.engine import make_transformers_policy
from grpo.loop.config import validate_config
from grpo.process.errors import DataError
from grpo.tasks.envs import load_splits, make_env
from grpo.tasks.prompt_checks import check_prompt_lengths
from grpo.tasks.settings import TaskSettings
from grpo.training.models import load_policy_model, load_tokenizer
from grpo.training.settings import ModelSettings

EXAMPLE = REPO / "examples" / "my_task"
ROWS = [{"prompt": "What is 2 + 3?", "answer": 5, "level": 1},
        {"prompt": "What is 4 * 6?", "answer": 24, "level": 2}]
FUNCTIONS = """
def exact(reply, answer):
    return reply == str(answer)  # a bool counts as a number

def longer(reply, level, **row):
    assert sorted(row) == ["answer", "prompt"], row  # the other columns; prompt is the row's text
    return level * len(reply) / 10

def in_prompt(prompt, reply):  # batched: lists, one entry per reply
    return [float(r in p) for p, r in zip(prompt, reply)]
in_prompt.batched = True
"""


@pytest.fixture()
def tiny_tok():
    return load_tokenizer(str(TINY_MODEL))


def scored(env, replies):
    """Step ``env`` with ``replies`` (one per env slot) as the assistant's turn; its ``next`` tensordict."""
    td = env.reset()
    reply = History(role=["assistant"] * len(replies), content=replies, batch_size=(len(replies),)).unsqueeze(-1)
    td["history", "full"] = td["history", "prompt"].extend(reply, inplace=False, dim=-1)
    return env.step(td)["next"]


def test_generic_reward_is_the_weighted_sum_of_the_functions(tmp_path, tiny_tok):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "fns.py").write_text(FUNCTIONS)
    cfg = compose("grpo_tiny", [f"model.name={TINY_MODEL}", "env.task=generic", f"env.dataset={tmp_path}",
                                "env.test_split=train", "reward.weights=[1.0,0.5,2.0]", "reward.success_threshold=1.0",
                                f"reward.functions=[{tmp_path}/fns.py:exact,{tmp_path}/fns.py:longer,"
                                f"{tmp_path}/fns.py:in_prompt]"])
    validate_config(cfg)
    settings = TaskSettings.from_config(cfg)
    load_splits(settings)  # the start checks pass: every parameter is an argument the rows offer
    env = make_env(settings, tiny_tok, split="train", repeats=2, num_envs=4, shuffle=False)
    # rows 0, 0, 1, 1; each reply's trailing special tokens are not part of it
    nxt = scored(env, ["5<|im_end|>", "2 + 3", "24<|im_end|><|endoftext|>", "It is 42."])
    expected = [1.0 + 0.5 * 1 * 1 / 10 + 2.0 * 0,
                0.0 + 0.5 * 1 * 5 / 10 + 2.0 * 1,
                1.0 + 0.5 * 2 * 2 / 10 + 2.0 * 0,
                0.0 + 0.5 * 2 * 9 / 10 + 2.0 * 0]
    assert nxt["reward"].shape == (4, 1, 1)
    assert nxt["reward"].view(-1).tolist() == pytest.approx(expected)
    assert nxt["success"].view(-1).tolist() == [r > 1.0 for r in expected]
    assert nxt["done"].all()
    # the prompt is the row's text as the user turn, with no system turn unless env.system_prompt sets one
    prompt = env.reset()["history", "prompt"][0]
    assert prompt.role == ["user"] and prompt.content == ["What is 2 + 3?"]


def test_gsm8k_adds_the_functions_to_its_own_reward(tmp_path, tiny_tok):
    (tmp_path / "bonus.py").write_text("def bonus(reply, question, answer):\n"
                                       "    return 0.5 if answer.endswith(' 25') and 'stickers' in question else 0.0\n")
    base = [f"model.name={TINY_MODEL}", f"env.dataset={TINY_DATA}"]
    replies = ["<think>19 + 6 = 25</think><answer>25</answer>", "25", "<answer>8</answer>", "7"]
    own = scored(make_env(TaskSettings.from_config(compose("grpo_tiny", base)), tiny_tok, split="test", repeats=2,
                          num_envs=4, shuffle=False), replies)
    cfg = compose("grpo_tiny", [*base, f"reward.functions=[{tmp_path}/bonus.py:bonus]", "reward.weights=[2.0]"])
    with_bonus = scored(make_env(TaskSettings.from_config(cfg), tiny_tok, split="test", repeats=2, num_envs=4,
                                 shuffle=False), replies)
    # test.jsonl rows 0 (19 stickers + 6, answer 25) and 1 (4 * 2, answer 8), each twice
    assert (with_bonus["reward"] - own["reward"]).view(-1).tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0])
    assert with_bonus["success"].equal(own["success"])  # accuracy stays GSM8K's
    assert own["reward"].view(-1).tolist() == pytest.approx([1.1, 0.0, 1.0, 0.0])


def test_ifeval_adds_the_functions_to_its_own_reward(tmp_path, tiny_tok):
    (tmp_path / "bonus.py").write_text("def bonus(prompt, reply, instruction_id_list):\n"
                                       "    return 0.25 * len(instruction_id_list) + ('lemons' in prompt)\n")
    base = [f"model.name={TINY_MODEL}"]
    replies = ["LEMONS ARE SOUR.", "Forests are green."]
    own = scored(make_env(TaskSettings.from_config(compose("grpo_ifeval_tiny", base)), tiny_tok, split="test",
                          repeats=1, num_envs=2, shuffle=False), replies)
    cfg = compose("grpo_ifeval_tiny", [*base, f"reward.functions=[{tmp_path}/bonus.py:bonus]"])
    with_bonus = scored(make_env(TaskSettings.from_config(cfg), tiny_tok, split="test", repeats=1, num_envs=2,
                                 shuffle=False), replies)
    # test.jsonl rows 0 (lemons, all lowercase) and 1 (forests without commas), one instruction each
    assert (with_bonus["reward"] - own["reward"]).view(-1).tolist() == pytest.approx([1.25, 0.25])
    assert with_bonus["success"].equal(own["success"]) and own["success"].view(-1).tolist() == [False, True]


@pytest.mark.parametrize("system_prompt", [None, "Answer with a number."])
def test_the_length_check_counts_generic_prompts_as_the_policy_sees_them(system_prompt, tmp_path, tiny_tok):
    (tmp_path / "train.jsonl").write_text(json.dumps(ROWS[0]) + "\n")
    overrides = [f"model.name={TINY_MODEL}", "env.task=generic", f"env.dataset={tmp_path}", "env.test_split=train",
                 f"reward.functions=[{EXAMPLE}/reward.py:tagged]", f"env.system_prompt={json.dumps(system_prompt)}"]
    cfg = compose("grpo_tiny", overrides)
    settings = TaskSettings.from_config(cfg)
    env = make_env(settings, tiny_tok, split="train", repeats=1, num_envs=1)
    policy_model = load_policy_model(ModelSettings.from_config(cfg), tiny_tok, torch.device("cpu"))
    sampler = ReplySampler(policy_model, compile=False, cache_bucket=64, compact_rows=True)
    policy = make_transformers_policy(sampler, tiny_tok, gen_kwargs={
        "max_new_tokens": 1, "do_sample": False, "eos_token_id": [tiny_tok.eos_token_id],
        "pad_token_id": tiny_tok.pad_token_id})
    prompt_tokens = len(policy(env.reset()).get(("tokens", "prompt"), as_list=True)[0])
    splits = load_splits(settings)
    fits = prompt_tokens + cfg.inference_model.max_new_tokens  # the reply's room: exactly full fits
    check_prompt_lengths(TaskSettings.from_config(
        compose("grpo_tiny", [*overrides, f"inference_model.max_model_len={fits}"])), tiny_tok, splits)
    with pytest.raises(DataError, match=f"row 0: its prompt is {prompt_tokens} tokens"):
        check_prompt_lengths(TaskSettings.from_config(
            compose("grpo_tiny", [*overrides, f"inference_model.max_model_len={fits - 1}"])), tiny_tok, splits)


def readme_command() -> list[str]:
    """The README's "Your own task" command, as a shell would split it."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Your own task", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(python grpo/grpo.py .*?)```", section, re.DOTALL).group(1)
    return shlex.split(block.replace("\\\n", " "))


def test_readme_links_the_example_files_and_its_command_names_their_functions():
    """The README links the example rather than copying it: the links resolve, and every reward function
    its command names is defined in the file it points to."""
    readme = (REPO / "README.md").read_text()
    for name in ("reward.py", "train.jsonl"):
        assert f"](examples/my_task/{name})" in readme and (EXAMPLE / name).is_file(), name
    functions = re.findall(r"examples/my_task/reward.py:(\w+)", " ".join(readme_command()))
    assert functions == ["correct", "tagged"]
    assert all(f"def {name}(" in (EXAMPLE / "reward.py").read_text() for name in functions)
    assert len((EXAMPLE / "reward.py").read_text().splitlines()) < 30
    assert len((EXAMPLE / "train.jsonl").read_text().splitlines()) == 5


def test_the_readme_example_learns_on_cpu(tmp_path, monkeypatch):
    """The README command (30 steps): the mean reward of the last 10 steps clearly beats the first 5's (seeds 0-4,
    last 5 against first 5, measured before transformers 5.24: +0.16 to +0.46; 20 steps were too few to tell, +0.11
    to +0.41). With transformers 5.24 seed 0 reaches its plateau by step 11 (0.20 -> 0.34) and dips twice in its
    last 5 steps, so the last 5 alone gained +0.12 and the last 10 +0.13; a 5-step mean varies by about 0.02."""
    command = readme_command()
    assert command[:4] == ["python", "grpo/grpo.py", "--config-name", "grpo_tiny"]
    # grpo/grpo.py's train on the command's overrides in this process, from the repo root as the README runs it: the
    # launch (a new process's ~9 s of imports) is the other script tests'
    monkeypatch.chdir(REPO)
    train_in_process(tmp_path, [*command[4:], "eval.frequency=0", "logging.progress_bar=false", "logging.export=false"])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    assert len(rewards) == 30
    assert sum(rewards[-10:]) / 10 > sum(rewards[:5]) / 5 + 0.1, rewards
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [e["step"] for e in evals] == [0, 30] and all(e["eval/num_problems"] == 5 for e in evals)


def test_a_bad_return_value_ends_the_script_with_one_error_line(tmp_path):
    """A module from the working directory, returning NaN: the first call (the step-0 eval) stops the run."""
    (tmp_path / "my_rewards.py").write_text("def score(reply):\n    return float('nan')\n")
    proc = subprocess.run([sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-name", "grpo_tiny",
                           "env.task=generic", f"env.dataset={EXAMPLE}", "env.prompt_key=question",
                           "env.test_split=train", "reward.functions=[my_rewards:score]", "logging.progress_bar=false",
                           f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "failed (" not in proc.stderr  # no note on a checkpoint it cannot have
    assert proc.stderr.splitlines()[-1].startswith(
        "error: reward.functions[0]='my_rewards:score' returned nan for a reply to row "), proc.stderr[-3000:]


def async_generic_run(tmp_path, *overrides) -> list[str]:
    """grpo-async.py on the example data, scored by ``my_rewards:score`` from the working directory ``tmp_path``."""
    return [sys.executable, str(REPO / "grpo" / "grpo-async.py"), "--config-name", "grpo_tiny", "env.task=generic",
            f"env.dataset={EXAMPLE}", "env.prompt_key=question", "env.test_split=train",
            "reward.functions=[my_rewards:score]", "env.num_envs=20", "env.repeats=4",
            "train.dialog_turns_per_batch=20", "train.optim_batch_size=20", "ray.num_cpus=2", "train.total_steps=2",
            "logging.progress_bar=false", f"hydra.run.dir={tmp_path / 'run'}", *overrides]


NAN_IN_WORKERS = """import ray


def score(reply):
    in_rollout_worker = ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    return float("nan") if in_rollout_worker else 1.0
"""


def test_a_bad_return_in_a_rollout_worker_stops_the_run_without_restarts(tmp_path):
    """The trainer's eval passes; the worker's first batch fails: restarting it would only fail again."""
    (tmp_path / "my_rewards.py").write_text(NAN_IN_WORKERS)
    proc = subprocess.run(async_generic_run(tmp_path), cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": ""}, timeout=400)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "restart" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1].startswith(
        "error: reward.functions[0]='my_rewards:score' returned nan for a reply to row "), proc.stderr[-3000:]


HANGS_IN_WORKERS = """import threading

import ray


def score(reply):
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:  # a rollout worker
        threading.Event().wait()
    return 1.0
"""


def test_a_reward_function_that_hangs_in_a_rollout_worker_ends_the_run_naming_it_and_its_row(tmp_path):
    """The async run hung as the sync one did: no word, and SIGTERM did not end it."""
    (tmp_path / "my_rewards.py").write_text(HANGS_IN_WORKERS)
    proc = subprocess.run(async_generic_run(tmp_path, "reward.timeout_s=3"), cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ""}, timeout=400)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "restart" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.fullmatch(r"error: reward.functions\[0\]='my_rewards:score' took longer than reward.timeout_s=3 s on "
                        r"row \d+ \(split 'train'\) and was abandoned; .*", proc.stderr.splitlines()[-1]), \
        proc.stderr[-3000:]


CALLS = """import os
from pathlib import Path


def score(reply, answer):
    with open(Path(__file__).with_name("calls.txt"), "a") as calls:  # who scored: the trainer or a worker
        calls.write(f"{os.getpid()}\\n")
    return float(str(answer) in reply)
"""


def test_user_functions_score_in_the_async_rollout_workers(tmp_path):
    """A module found in the working directory, imported by the trainer (eval) and the Ray workers (rollouts)."""
    (tmp_path / "my_rewards.py").write_text(CALLS)
    proc = subprocess.Popen(async_generic_run(tmp_path, "train.epochs=1", "eval.frequency=0", "logging.export=false"),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ""})
    _, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2]
    pids = [int(line) for line in (tmp_path / "my_rewards.py").with_name("calls.txt").read_text().split()]
    trainer = [p for p in pids if p == proc.pid]
    assert len(trainer) == 2 * 5  # the two evals (steps 0 and 2), 5 rows each
    assert len(pids) - len(trainer) >= 2 * 20  # the workers scored (at least) the two trained batches
    assert torch.tensor([r["reward"] for r in rows if "reward" in r]).isfinite().all()
    assert all(r["reward_s"] > 0 for r in rows if "reward" in r)  # the workers' time in the function
    assert all(r["generation_engine_s"] > 0 for r in rows if "reward" in r)  # and in their engines' generate calls
