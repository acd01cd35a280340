"""grpo/training/batch.py: what counts as a trained token in the dense training batch."""

import torch

from grpo.training.batch import rollout_metrics, to_training_batch
from grpo.training.replies import Replies

EOS, PAD = 2, 0


def replies_of(*rollouts: tuple, **per_episode) -> Replies:
    """(prompt, episode, sampler log-probs, sampled marks) tuples, each its own group, reward 1."""
    prompts, replies, log_probs, masks = zip(*rollouts)
    n = len(rollouts)
    return Replies.from_sequences(prompts=prompts, replies=replies, log_probs=log_probs, sampled_masks=masks,
                                  reward=[1.0] * n, success=[True] * n, row_index=list(range(n)),
                                  user_prompts=["q"] * n, **per_episode)


def test_only_sampled_tokens_are_trained_on_and_counted():
    """An episode's environment turn (a tool's output) is context: attended to, never in the loss mask, the
    sampler's log-probs or the reply lengths; a truncated episode is not 'stopped'."""
    data = replies_of(
        ([5, 6, 7], [8, 9, EOS, 30, 31, 32, 10, EOS], [-1.0, -0.5, -0.25, 0, 0, 0, -0.7, -0.1],
         [1, 1, 1, 0, 0, 0, 1, 1]),                                          # two turns, a tool's three tokens
        ([5, 6], [8, 9, 10, 11, 12], [-0.2] * 5, [1] * 5),                   # one turn cut at max_new_tokens
        ([5], [8, PAD], [-0.3, -0.4], [1, 1]),                               # ended by the pad token
        truncated=[False, True, False], turns=[2, 1, 1], tool_calls=[1, 0, 0], tool_errors=[1, 0, 0])
    batch = to_training_batch(data, pad_token_id=PAD)
    assert batch["reply_length"].tolist() == [8, 5, 2]
    assert batch["attention_mask"].sum(-1).tolist() == [3 + 8, 2 + 5, 1 + 2]
    assert batch["reply_mask"][0].tolist() == [True, True, True, False, False, False, True, True]
    assert batch["sampled_length"].tolist() == [5, 5, 2]
    assert batch["reply_stopped"].tolist() == [True, False, True]
    assert torch.equal(batch["behaviour_log_probs"][0], torch.tensor([-1.0, -0.5, -0.25, 0, 0, 0, -0.7, -0.1]))
    stats = rollout_metrics(data, batch)
    assert abs(stats["response_length"] - (5 + 5 + 2) / 3) < 1e-6
    assert stats["response_length_max"] == 5
    assert abs(stats["response_truncated_fraction"] - 1 / 3) < 1e-6
    assert abs(stats["episode/turns"] - 4 / 3) < 1e-6 and abs(stats["tools/calls_per_episode"] - 1 / 3) < 1e-6
    assert stats["tools/error_rate"] == 1.0 and stats["tools/timeout_rate"] == 0.0


def test_an_episode_whose_sandbox_failed_leaves_the_loss_and_its_group_baseline():
    """A tool call the sandbox could not run is not the model's doing: its episode trains on nothing and its
    reward does not enter the group's mean and std (scoring it 0 would punish the model for the machine)."""
    from grpo.training.advantages import group_advantages

    same_prompt = [5, 6]
    data = replies_of(*[(same_prompt, [8, EOS], [-0.1, -0.2], [1, 1])] * 3, tool_failures=[0, 0, 1])
    data.reward = torch.tensor([1.0, 0.0, 0.0])
    batch = to_training_batch(data, pad_token_id=PAD)
    assert batch["reply_mask"].sum(-1).tolist() == [2, 2, 0] and batch["in_baseline"].tolist() == [True, True, False]
    advantage = group_advantages(batch["reward"], batch["group_id"], in_baseline=batch["in_baseline"])
    # the two counted replies alone: mean 0.5, std (unbiased) 0.7071
    expected = torch.tensor([0.5 / 0.5 ** 0.5, -0.5 / 0.5 ** 0.5, 0.0])
    assert torch.allclose(advantage, expected, atol=1e-6)
