"""DAPO dynamic sampling: steps are filled with groups whose rewards differ, within a bound."""

import pytest

from grpo.rollout.dynamic_sampling import draw_step_batch, reply_groups
from grpo.training.replies import Replies

REPEATS = 4


def batch_of(group_rewards: list[list[float]], first_prompt: int):
    """Rollouts of whole groups: prompt k is the token sequence [k, k]; a reply's reward as given."""
    prompts = [k for k, rewards in enumerate(group_rewards, start=first_prompt) for _ in rewards]
    rewards = [reward for group in group_rewards for reward in group]
    return Replies.from_sequences(prompts=[[k, k] for k in prompts], replies=[[7]] * len(prompts),
                                  log_probs=[[-1.0]] * len(prompts), reward=rewards,
                                  success=[r > 0 for r in rewards], row_index=prompts,
                                  user_prompts=[str(k) for k in prompts])


def drawer(batches):
    """``draw`` over a fixed list of collections; ``drawn`` counts the calls."""
    def draw():
        draw.drawn += 1
        return batches[draw.drawn - 1]
    draw.drawn = 0
    return draw


def prompts_of(rollouts) -> list[int]:
    return [int(rollouts.prompts()[g[0]][0]) for g in reply_groups(rollouts)]


MIXED, ZEROS, ONES = [0.0, 1.0, 0.0, 0.0], [0.0] * REPEATS, [1.0] * REPEATS


def test_off_returns_the_one_collection_and_counts_its_uniform_groups():
    first = batch_of([MIXED, ZEROS, ONES, MIXED], 0)
    draw = drawer([first])
    rollouts, metrics = draw_step_batch(draw, 16, dynamic=False, max_extra_batches=4)
    assert rollouts is first and draw.drawn == 1
    assert metrics == {"uniform_group_fraction": 0.5}


def test_uniform_groups_are_replaced_by_groups_from_extra_collections():
    draw = drawer([batch_of([MIXED, ZEROS, ONES, MIXED], 0), batch_of([ZEROS, MIXED, MIXED, MIXED], 10)])
    rollouts, metrics = draw_step_batch(draw, 16, dynamic=True, max_extra_batches=4)
    assert draw.drawn == 2
    assert prompts_of(rollouts) == [0, 3, 11, 12]  # the informative groups in draw order; surplus 13 dropped
    assert len(rollouts) == 16
    assert metrics == {"filtered_groups": 3, "uniform_group_fraction": 3 / 8, "extra_generation_batches": 1}


def test_a_full_first_collection_draws_nothing_more():
    draw = drawer([batch_of([MIXED] * 4, 0)])
    rollouts, metrics = draw_step_batch(draw, 16, dynamic=True, max_extra_batches=4)
    assert draw.drawn == 1 and prompts_of(rollouts) == [0, 1, 2, 3]
    assert metrics["extra_generation_batches"] == 0 and metrics["filtered_groups"] == 0


def test_past_the_bound_the_step_is_topped_up_with_uniform_groups():
    draw = drawer([batch_of([MIXED, ZEROS, ONES, ZEROS], 0), batch_of([ONES, ZEROS, ZEROS, ONES], 10),
                   batch_of([MIXED] * 4, 20)])
    rollouts, metrics = draw_step_batch(draw, 16, dynamic=True, max_extra_batches=1)
    assert draw.drawn == 2  # the third collection is past the bound
    assert len(rollouts) == 16  # the LR schedule counts on full steps
    assert prompts_of(rollouts) == [0, 1, 2, 3]  # the informative group, then uniform ones in draw order
    assert metrics == {"filtered_groups": 4, "uniform_group_fraction": 7 / 8, "extra_generation_batches": 1}


def test_groups_are_found_by_prompt_whatever_the_reply_order():
    rollouts = batch_of([MIXED, ZEROS], 0)
    shuffled = rollouts.select([4, 0, 5, 1, 6, 2, 7, 3])
    assert reply_groups(shuffled) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    picked, metrics = draw_step_batch(drawer([shuffled]), 4, dynamic=True, max_extra_batches=0)
    assert picked.reward.tolist() == MIXED
    assert metrics["filtered_groups"] == 1


@pytest.mark.parametrize("rewards", [[0.5] * REPEATS, [-1.0] * REPEATS])
def test_any_constant_reward_is_uniform(rewards):
    _, metrics = draw_step_batch(drawer([batch_of([rewards, MIXED], 0)]), 8, dynamic=True, max_extra_batches=0)
    assert metrics["uniform_group_fraction"] == 0.5
