"""grpo/training/replies.py: the batch a rollout source hands the trainer keeps every field the trainer reads,
exactly, through pickling as Ray and torchrun's object broadcast do it."""

import pickle

import pytest
import torch

from grpo.training.batch import to_training_batch
from grpo.training.replies import TENSORS, Replies, last_user_message
from test_step import setup  # noqa: F401 - a fixture: rollouts of the tiny model, 2 groups of 4


def through_ray_style_pickle(replies: Replies) -> tuple[Replies, int, int]:
    """Pickle protocol 5 with out-of-band buffers handed back read-only, as Ray's object store does; returns
    the copy, the in-band stream's bytes and the out-of-band bytes."""
    buffers = []
    stream = pickle.dumps(replies, protocol=5, buffer_callback=buffers.append)
    views = [memoryview(b.raw()).toreadonly() for b in buffers]
    return pickle.loads(stream, buffers=views), len(stream), sum(v.nbytes for v in views)


def test_every_field_the_trainer_reads_survives_conversion_and_pickling(setup):  # noqa: F811
    _, _, _, rollouts, _ = setup
    n = rollouts.batch_size[0]
    sent = Replies.from_collector(rollouts)
    for received in (pickle.loads(pickle.dumps(sent)), through_ray_style_pickle(sent)[0]):
        assert len(received) == n
        for i, sample in enumerate(rollouts.unbind(0)):
            assert torch.equal(received.prompts()[i], sample["tokens", "prompt"])
            assert torch.equal(received.replies()[i], sample["tokens", "response"])
            assert torch.equal(received.log_probs()[i], sample["log_probs", "response"].float())
            history = sample["history", "prompt"]
            assert received.user_prompts[i] == last_user_message(history.role, history.content)
        assert torch.equal(received.reward, rollouts.get(("next", "reward")).reshape(n))
        assert torch.equal(received.success, rollouts.get(("next", "success")).reshape(n))
        assert torch.equal(received.row_index, rollouts.get("row_index"))
        assert all(isinstance(text, str) and text for text in received.user_prompts)
        # the dense batch the GRPO step trains on is the same from either side
        before, after = to_training_batch(sent, 0), to_training_batch(received, 0)
        assert before.keys() == after.keys()
        for key in before.keys():
            assert torch.equal(before[key], after[key]), key


def test_tensors_travel_out_of_band_and_come_back_writable(setup):  # noqa: F811
    _, _, _, rollouts, _ = setup
    sent = Replies.from_collector(rollouts)
    received, in_band, out_of_band = through_ray_style_pickle(sent)
    tensor_bytes = sum(getattr(sent, name).numel() * getattr(sent, name).element_size() for name in TENSORS)
    assert out_of_band == tensor_bytes  # every tensor as one raw buffer, none pickled in the stream
    assert in_band < 2 * sum(len(text) for text in sent.user_prompts) + 2000  # the stream: the texts and names
    received.reward += 1  # the trainer's own memory, not the object store's read-only pages
    assert torch.equal(received.reward, sent.reward + 1)


def test_select_and_cat_keep_each_reply_whole():
    replies = Replies.from_sequences(prompts=[[1, 2], [3], [4, 5, 6]], replies=[[7], [8, 9], []],
                                     log_probs=[[-0.5], [-0.25, -0.75], []], reward=[0.0, 1.0, 0.5],
                                     success=[False, True, False], row_index=[10, 11, 12], user_prompts=["a", "b", "c"])
    picked = Replies.cat([replies.select([2, 0]), replies.select([1])])
    assert [p.tolist() for p in picked.prompts()] == [[4, 5, 6], [1, 2], [3]]
    assert [r.tolist() for r in picked.replies()] == [[], [7], [8, 9]]
    assert [lp.tolist() for lp in picked.log_probs()] == [[], [-0.5], [-0.25, -0.75]]
    assert picked.reward.tolist() == [0.5, 0.0, 1.0] and picked.success.tolist() == [False, False, True]
    assert picked.row_index.tolist() == [12, 10, 11] and picked.user_prompts == ["c", "a", "b"]


def test_a_log_prob_per_reply_token_is_required():
    with pytest.raises(ValueError, match="reply 0 has 2 tokens but 1 sampler log-probs"):
        Replies.from_sequences(prompts=[[1]], replies=[[2, 3]], log_probs=[[-0.5]], reward=[0.0], success=[False],
                               row_index=[0], user_prompts=["q"])
