"""Sync on 2 CPU ranks that each generate (``train_model.num_devices=2 inference_model.num_devices=2``): every rank
draws its share of each prompt batch, whole prompts, on its own engine, which every push reaches; the run trains on
the prompt batches one rank would and learns as one rank does; a kill -9 and ``resume=`` continue it exactly."""

import json
from collections import Counter

import pytest
import torch

from conftest import SHORT_RUN, TINY_DATA, TINY_MODEL, compose
from grpo.tasks.paths import resolve_local_paths
from grpo.tasks.data import PromptStream, data_primer
from grpo.tasks.envs import make_env
from grpo.tasks.settings import TaskSettings
from grpo.training.models import load_tokenizer
from test_ranks import STEPS, all_gone, assert_same_weights, command, kill_after_step_2_checkpoint, one_rank_steps, \
    run, trained

EVERY_RANK_GENERATES = ["inference_model.num_devices=2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """4 steps from seed 0, checkpointed at step 2: one rank, and two ranks each generating its share (the ranks
    started by rank 0 itself): (steps' metrics, exported weights, run dir) each."""
    two = tmp_path_factory.mktemp("two_generating")
    return {1: one_rank_steps(tmp_path_factory),  # in-process: the reference, not under test; test_ranks.py's too
            2: (*trained(two, [*STEPS, *EVERY_RANK_GENERATES], ranks=2, torchrun=False), two)}


def eval_accuracy(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}


def test_two_generating_ranks_train_on_one_rank_s_prompts_and_learn_as_one(runs):
    """Each step trains on the prompt batch one rank draws; every rank's engine holds rank 0's weights at every
    collection (the checksums read back from each engine agree: a follower that missed a push would differ from
    step 2 on); rewards and held-out accuracy are one rank's within sampling noise."""
    (one, _, one_dir), (two, _, two_dir) = runs[1], runs[2]
    assert sorted(one) == sorted(two) == [1, 2, 3, 4]
    for step, row in one.items():
        assert two[step]["prompt_indices"] == row["prompt_indices"], step
        assert two[step]["engine_weights_mismatched"] == 0, step
        assert two[step]["generation_s_slowest_rank"] > 0, step
    # 16 replies a step are noisy: one rank's step-1 reward was 0.62, 0.56, 0.28 at seeds 1-3. A rank generating
    # replies that score nothing would halve the mean (0.86 here on one rank)
    mean_reward = {ranks: sum(r["reward"] for r in steps.values()) / 4 for ranks, steps in ((1, one), (2, two))}
    assert mean_reward[2] == pytest.approx(mean_reward[1], abs=0.3), mean_reward
    assert two[3]["reward"] + two[4]["reward"] > two[1]["reward"] + two[2]["reward"], two  # it learns
    accuracy = {1: eval_accuracy(one_dir), 2: eval_accuracy(two_dir)}
    assert accuracy[2][0] == accuracy[1][0]  # the same weights at step 0, greedy
    assert accuracy[2][4] >= accuracy[2][0] and accuracy[2][4] == pytest.approx(accuracy[1][4], abs=0.25), accuracy


def rows_drawn(cfg, tokenizer, batch: int, rank: int, ranks: int) -> tuple[list[int], PromptStream]:
    """The data rows of the replies rank ``rank`` of ``ranks`` generates for prompt batch ``batch``, as its env
    (``rank_rollouts``') draws them, and the prompt stream it draws from."""
    env = make_env(TaskSettings.from_config(cfg), tokenizer, split=cfg.env.train_split, repeats=cfg.env.repeats,
                   num_envs=cfg.env.num_envs // ranks)
    primer = data_primer(env)
    primer.dataloader.share_of(rank, ranks, cfg.env.num_envs // cfg.env.repeats)
    primer._queue.clear()
    primer.dataloader.position = batch * (cfg.env.num_envs // cfg.env.repeats // ranks)  # serve_from's
    return env.reset()["row_index"].reshape(-1).tolist(), primer.dataloader.stream


@pytest.mark.parametrize("batch", [0, 3, 7])
def test_each_rank_draws_its_share_of_a_prompt_batch_by_whole_prompts(batch):
    """Batch ``b`` of 8 prompts x 4 replies over 2 ranks: each rank draws 4 prompts, each 4 times (whole groups),
    the two shares are disjoint, and together they are the batch one rank draws, prompt for prompt."""
    cfg = compose("grpo_tiny", [f"model.name={TINY_MODEL}", f"env.dataset={TINY_DATA}", "env.num_envs=32",
                                "env.repeats=4"])
    resolve_local_paths(cfg)
    tokenizer = load_tokenizer(cfg.model.name)
    rows, stream = rows_drawn(cfg, tokenizer, batch, 0, 1)
    alone = Counter(rows)
    shares = [Counter(rows_drawn(cfg, tokenizer, batch, rank, 2)[0]) for rank in (0, 1)]
    for share in shares:
        assert len(share) == 4 and set(share.values()) == {4}
    assert not set(shares[0]) & set(shares[1])
    assert shares[0] + shares[1] == alone and set(alone) == set(stream.batch(batch, 8))


def test_a_generating_two_rank_run_killed_after_a_checkpoint_resumes_exactly(runs, tmp_path):
    """kill -9 of every rank once the step-2 checkpoint is written; ``resume=`` trains steps 3 and 4 on the prompt
    batches of the run never stopped, samples the same replies (every rank's sampling follows rank 0's RNG, which
    the checkpoint keeps), and ends with its weights."""
    overrides = [*STEPS, *EVERY_RANK_GENERATES]
    kill_after_step_2_checkpoint(command(tmp_path, overrides, ranks=2, torchrun=False), tmp_path)
    steps, export = trained(tmp_path, [*overrides, f"resume={tmp_path}"], ranks=2, torchrun=False)
    uninterrupted, uninterrupted_export, _ = runs[2]
    assert sorted(steps) == [1, 2, 3, 4]
    for step in (3, 4):
        for key in ("prompt_indices", "reward"):
            assert steps[step][key] == uninterrupted[step][key], (step, key)
    assert_same_weights(export, uninterrupted_export)


def test_more_inference_engines_than_ranks_is_one_line(tmp_path):
    """Sync on 2 ranks asking for 3 inference engines: the one-line error, and every rank exits."""
    proc = run(tmp_path, [*SHORT_RUN, "inference_model.num_devices=3"], ranks=2, timeout=120, torchrun=False)
    assert proc.returncode != 0 and all_gone(proc.session)
    said = [text for text in proc.stderr.splitlines() if text.startswith("error:")]
    assert said == ["error: inference_model has 3 GPUs but sync generates with one engine on one GPU (rank 0's) or "
                    "one per trainer rank (2): 1 would idle (0 GPU(s) visible). Fix: inference_model.num_devices=2, "
                    "or run the async script with train.num_collectors=3"], proc.stderr[-4000:]


NAN_ON_RANK_1 = """import os
calls = 0
def nan_on_rank_1(reply: str) -> float:
    global calls
    calls += 1
    return float("nan") if os.environ.get("RANK") == "1" and calls > 16 else 1.0
"""


def test_a_user_error_on_a_generating_follower_stops_every_rank_with_one_line(tmp_path):
    """A reward function that returns NaN on rank 1's replies of step 3 (its 17th call, 8 a step there): rank 0
    reports rank 1's one line, writes the emergency checkpoint of step 2 with rank 1's shards, and every rank exits."""
    (tmp_path / "rewards.py").write_text(NAN_ON_RANK_1)
    overrides = [*SHORT_RUN, *EVERY_RANK_GENERATES, "train.total_steps=5", "env.task=generic",
                 "env.dataset=examples/my_task", "env.prompt_key=question", "env.test_split=train",
                 f"reward.functions=[{tmp_path}/rewards.py:nan_on_rank_1]"]
    proc = run(tmp_path / "run", overrides, ranks=2, timeout=120, torchrun=False)
    assert proc.returncode != 0 and all_gone(proc.session)
    said = [text for text in proc.stderr.splitlines() if text.startswith("error:")]
    assert len(said) == 1 and said[0].startswith(
        f"error: reward.functions[0]='{tmp_path}/rewards.py:nan_on_rank_1' returned nan"), proc.stderr[-4000:]
    assert (tmp_path / "run" / "checkpoints" / "step_00000002.json").exists()
