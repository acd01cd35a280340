"""grpo/training/batch.py: what counts as a reply token in the dense training batch."""

from grpo.rollout.replies import Replies
from grpo.training.batch import rollout_metrics, to_training_batch

EOS, PAD = 2, 0


def replies_of(*rollouts: tuple[list[int], list[int], list[float]]) -> Replies:
    """(prompt, reply, sampler log-probs) triples, each its own group, reward 1."""
    prompts, replies, log_probs = zip(*rollouts)
    n = len(rollouts)
    return Replies.from_sequences(prompts=prompts, replies=replies, log_probs=log_probs, reward=[1.0] * n,
                                  success=[True] * n, row_index=list(range(n)), user_prompts=["q"] * n)


def test_a_reply_ends_at_its_first_stop_token():
    """An engine that pads finished replies with eos (SmolLM2's generation_config does) must not
    turn that padding into reply tokens: not in the loss mask, the log-probs or the lengths."""
    data = replies_of(
        ([5, 6, 7], [8, 9, EOS, EOS, EOS], [-1.0, -0.5, -0.25, -14.0, -13.0]),  # padded with eos
        ([5, 6], [8, 9, 10, 11, 12], [-0.2] * 5),                                # cut at max_new_tokens
        ([5], [8, PAD], [-0.3, -0.4]),                                          # ended by the pad token
    )
    batch = to_training_batch(data, pad_token_id=PAD)
    assert batch["reply_length"].tolist() == [3, 5, 2]
    assert batch["reply_mask"].sum(-1).tolist() == [3, 5, 2]
    assert batch["reply_stopped"].tolist() == [True, False, True]
    assert batch["behaviour_log_probs"][0].tolist() == [-1.0, -0.5, -0.25, 0.0, 0.0]
    stats = rollout_metrics(data, batch)
    assert abs(stats["response_length"] - (3 + 5 + 2) / 3) < 1e-6
    assert stats["response_length_max"] == 5
    assert abs(stats["response_truncated_fraction"] - 1 / 3) < 1e-6
