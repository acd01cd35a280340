"""grpo/inference/sampling.py: tokens drawn from the tempered, cut distribution, with its log-probs."""

import pytest
import torch

from grpo.inference.sampling import VOCAB_CHUNKS, chunked_argmax, sample_tokens, vocab_chunks


def test_sampling_follows_the_models_distribution():
    """Over many draws from fixed logits, token frequencies match softmax(logits / temperature), and
    top-k / top-p keep exactly the tokens they should; the log-prob is of that distribution (greedy: of
    the raw logits)."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(20000, 1)
    token, log_prob = sample_tokens(logits, greedy=False, temperature=2.0, top_k=0, top_p=1.0)
    freq = torch.bincount(token, minlength=5).float() / len(token)
    torch.testing.assert_close(freq, (logits[0] / 2.0).softmax(-1), atol=0.01, rtol=0)
    torch.testing.assert_close(log_prob, (logits[0] / 2.0).log_softmax(-1)[token])
    token, log_prob = sample_tokens(logits, greedy=False, temperature=1.0, top_k=2, top_p=1.0)
    assert set(token.tolist()) == {0, 1}
    torch.testing.assert_close(log_prob, logits[0, :2].log_softmax(-1)[token])
    probs = logits[0].softmax(-1)  # 0.53, 0.20, 0.12, 0.07, 0.03: top_p=0.7 keeps the first two
    token, log_prob = sample_tokens(logits, greedy=False, temperature=1.0, top_k=0, top_p=0.7)
    assert set(token.tolist()) == {0, 1}
    kept = probs[:2] / probs[:2].sum()
    torch.testing.assert_close(torch.bincount(token, minlength=2).float()[:2] / len(token), kept, atol=0.01, rtol=0)
    torch.testing.assert_close(log_prob, kept.log()[token])
    token, log_prob = sample_tokens(logits[:2], greedy=True, temperature=2.0, top_k=0, top_p=1.0)
    torch.testing.assert_close(log_prob, logits[:2].log_softmax(-1)[:, 0])


@pytest.mark.parametrize("vocab", [5, VOCAB_CHUNKS - 1, VOCAB_CHUNKS, VOCAB_CHUNKS + 1, 1000, 151936])
def test_chunked_reductions_equal_whole_row_ones(vocab):
    """Over vocabulary chunks (the last one padded), argmax and logsumexp equal torch's over the whole row: also
    where top-k left whole chunks at -inf, where every logit is far below 0, and on ties (the first maximum)."""
    torch.manual_seed(0)
    logits = torch.randn(6, vocab) * 8
    kept = logits.masked_fill(logits < logits.topk(min(3, vocab), -1).values[:, -1:], float("-inf"))
    for x in (logits, kept, kept - 500.0):
        assert torch.equal(chunked_argmax(vocab_chunks(x)), x.argmax(-1))
        torch.testing.assert_close(vocab_chunks(x).logsumexp(-1).logsumexp(-1), x.logsumexp(-1))
    ties = torch.zeros(2, vocab)
    ties[0, [vocab // 3, vocab - 1]] = 1.0
    assert chunked_argmax(vocab_chunks(ties)).tolist() == [vocab // 3, 0]


def test_a_draw_over_many_chunks_follows_the_distribution():
    """The two-stage draw (a chunk by its mass, then a token within it) over a vocabulary of several tokens a
    chunk, some chunks cut away whole by top-k: token frequencies match the tempered, cut softmax."""
    torch.manual_seed(0)
    vocab = 4 * VOCAB_CHUNKS + 3
    row = torch.randn(vocab) * 1.5
    logits = row.repeat(40000, 1)
    token, log_prob = sample_tokens(logits, greedy=False, temperature=0.7, top_k=40, top_p=1.0)
    scaled = row / 0.7
    kept = scaled.masked_fill(scaled < scaled.topk(40).values[-1], float("-inf"))
    assert (vocab_chunks(kept[None])[0, :vocab // 5] == float("-inf")).all(-1).any()  # a chunk cut whole (5 a chunk)
    freq = torch.bincount(token, minlength=vocab).float() / len(token)
    torch.testing.assert_close(freq, kept.softmax(-1), atol=0.006, rtol=0)
    torch.testing.assert_close(log_prob, kept.log_softmax(-1)[token])
