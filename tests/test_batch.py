"""grpo/training/batch.py: what counts as a reply token in the dense training batch."""

import torch
from tensordict import TensorDict, lazy_stack

from grpo.training.batch import to_training_batch
from grpo.training.batch import rollout_metrics

EOS, PAD = 2, 0


def rollout(prompt: list[int], reply: list[int], log_probs: list[float]) -> TensorDict:
    tokens = torch.tensor(prompt + reply)
    return TensorDict({
        "tokens": TensorDict({"prompt": tokens[:len(prompt)], "response": tokens[len(prompt):], "full": tokens}),
        "log_probs": TensorDict({"response": torch.tensor(log_probs)}),
        ("next", "reward"): torch.ones(1, 1),
        ("next", "success"): torch.ones(1, 1, dtype=torch.bool),
    })


def test_a_reply_ends_at_its_first_stop_token():
    """An engine that pads finished replies with eos (SmolLM2's generation_config does) must not
    turn that padding into reply tokens: not in the loss mask, the log-probs or the lengths."""
    data = lazy_stack([
        rollout([5, 6, 7], [8, 9, EOS, EOS, EOS], [-1.0, -0.5, -0.25, -14.0, -13.0]),  # padded with eos
        rollout([5, 6], [8, 9, 10, 11, 12], [-0.2] * 5),                                # cut at max_new_tokens
        rollout([5], [8, PAD], [-0.3, -0.4]),                                          # ended by the pad token
    ])
    batch = to_training_batch(data, pad_token_id=PAD, stop_token_ids=[PAD, EOS])
    assert batch["reply_length"].tolist() == [3, 5, 2]
    assert batch["reply_mask"].sum(-1).tolist() == [3, 5, 2]
    assert batch["reply_stopped"].tolist() == [True, False, True]
    assert batch["behaviour_log_probs"][0].tolist() == [-1.0, -0.5, -0.25, 0.0, 0.0]
    stats = rollout_metrics(data, batch)
    assert abs(stats["response_length"] - (3 + 5 + 2) / 3) < 1e-6
    assert stats["response_length_max"] == 5
    assert abs(stats["response_truncated_fraction"] - 1 / 3) < 1e-6
