"""grpo/training/logprobs.py: reply-token log-probs in bounded memory."""

import pytest
import torch

import grpo.training.logprobs
from grpo.training.batch import trim_padding
from grpo.training.logprobs import token_log_probs
from test_step import setup  # noqa: F401  (the fixture: the tiny model and a dense batch of its replies)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_in_chunks_equal_one_full_width_pass(setup, monkeypatch, temperature):
    """A small logit budget splits the LM head over many chunks of positions (recomputed in backward):
    log-probs, entropy and gradients are those of one pass over full [S, R, V] logits / temperature."""
    _, _, model, _, batch = setup
    part = trim_padding(batch[:4])
    width = part["reply_mask"].shape[1]

    def full_width():
        position_ids = (part["attention_mask"].long().cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=part["input_ids"], attention_mask=part["attention_mask"].long(),
                       position_ids=position_ids, logits_to_keep=width + 1).logits[:, :-1].float() / temperature
        log_probs = logits.log_softmax(-1)
        targets = part["input_ids"][:, -width:]
        return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_probs.exp() * log_probs).sum(-1)

    results = []
    for compute in (full_width, lambda: token_log_probs(model, part["input_ids"], part["attention_mask"], width,
                                                        with_entropy=True, entropy_grad=True,
                                                        temperature=temperature)):
        model.zero_grad(set_to_none=True)
        lp, entropy = compute()
        ((lp * part["reply_mask"]).sum() + entropy.mean()).backward()
        results.append((lp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
        monkeypatch.setattr(grpo.training.logprobs, "LOGIT_CHUNK_BYTES", 4 * model.config.vocab_size * 5)  # 5 positions a chunk
    (lp_full, ent_full, grads_full), (lp_chunked, ent_chunked, grads_chunked) = results
    assert part["input_ids"].shape[0] * width > 5 * 4  # many chunks, a partial one at the end
    torch.testing.assert_close(lp_chunked, lp_full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_chunked, ent_full, atol=1e-4, rtol=1e-4)  # lse - sum(p * logits): same value
    for g_chunked, g_full in zip(grads_chunked, grads_full):
        torch.testing.assert_close(g_chunked, g_full, atol=5e-5, rtol=1e-3)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_rows_give_the_dense_log_probs_entropy_and_gradients(setup, temperature):
    """Rows of different prompt and reply lengths, their real tokens end to end: each reply token's log-prob and
    entropy, and the gradients, are the padded rows'; the packed values are 0 at the pads."""
    _, _, model, _, batch = setup
    part = trim_padding(batch)
    width, mask = part["reply_mask"].shape[1], part["reply_mask"]
    assert len(set(part["prompt_length"].tolist())) > 1 and len(set(part["reply_length"].tolist())) > 1
    results = []
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        lp, entropy = token_log_probs(model, part["input_ids"], part["attention_mask"], width, with_entropy=True,
                                      entropy_grad=True, temperature=temperature, packed=packed)
        ((lp * mask).sum() + (entropy * mask).sum() / mask.sum()).backward()
        results.append((lp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]))
    (lp_dense, ent_dense, grads_dense), (lp_packed, ent_packed, grads_packed) = results
    torch.testing.assert_close(lp_packed[mask], lp_dense[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent_packed[mask], ent_dense[mask], atol=1e-5, rtol=1e-5)
    assert (lp_packed[~mask] == 0).all() and (ent_packed[~mask] == 0).all()
    for g_packed, g_dense in zip(grads_packed, grads_dense):
        torch.testing.assert_close(g_packed, g_dense, atol=5e-5, rtol=1e-3)
    model.zero_grad(set_to_none=True)
