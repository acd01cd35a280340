"""grpo/inference/sampling.py: tokens drawn from the tempered, cut distribution, with their log-probs under the
tempered distribution before the cut (the trainer's)."""

import pytest
import torch

from grpo.inference.sampling import VOCAB_CHUNKS, chunked_argmax, sample_tokens, vocab_chunks


def test_sampling_follows_the_models_distribution():
    """Over many draws from fixed logits, token frequencies match softmax(logits / temperature), and
    top-k / top-p keep exactly the tokens they should; the log-prob is of the tempered distribution before the cut
    (greedy: of the raw logits)."""
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(20000, 1)
    token, log_prob = sample_tokens(logits, greedy=False, temperature=2.0, top_k=0, top_p=1.0)
    freq = torch.bincount(token, minlength=5).float() / len(token)
    torch.testing.assert_close(freq, (logits[0] / 2.0).softmax(-1), atol=0.01, rtol=0)
    torch.testing.assert_close(log_prob, (logits[0] / 2.0).log_softmax(-1)[token])
    token, log_prob = sample_tokens(logits, greedy=False, temperature=1.0, top_k=2, top_p=1.0)
    assert set(token.tolist()) == {0, 1}
    torch.testing.assert_close(log_prob, logits[0].log_softmax(-1)[token])
    probs = logits[0].softmax(-1)  # 0.53, 0.20, 0.12, 0.07, 0.03: top_p=0.7 keeps the first two
    token, log_prob = sample_tokens(logits, greedy=False, temperature=1.0, top_k=0, top_p=0.7)
    assert set(token.tolist()) == {0, 1}
    kept = probs[:2] / probs[:2].sum()
    torch.testing.assert_close(torch.bincount(token, minlength=2).float()[:2] / len(token), kept, atol=0.01, rtol=0)
    torch.testing.assert_close(log_prob, probs.log()[token])
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
    torch.testing.assert_close(log_prob, scaled.log_softmax(-1)[token])


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton draw runs on a GPU")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_draw_follows_the_tempered_distribution_with_its_log_probs(dtype):
    """On a GPU (``grpo.inference.sampling_kernel``): over many rows of the same logits, spanning three of its
    vocabulary chunks of unequal mass, the chunks' and the tokens' frequencies match softmax(logits / temperature),
    and each log-prob is of that distribution, for bfloat16 logits too."""
    from grpo.inference.sampling_kernel import CHUNK

    torch.manual_seed(0)
    vocab = 2 * CHUNK + 904
    row = torch.randn(vocab) * 2
    row[:CHUNK] -= 1.0
    row = row.to(dtype)
    token, log_prob = sample_tokens(row.cuda().repeat(100000, 1), greedy=False, temperature=0.7, top_k=0, top_p=1.0,
                                     kernel=True)
    expected = (row.float() / 0.7).log_softmax(-1)
    freq = torch.bincount(token.cpu(), minlength=vocab).float() / len(token)
    chunk_mass = lambda p: torch.stack([p[:CHUNK].sum(), p[CHUNK:2 * CHUNK].sum(), p[2 * CHUNK:].sum()])  # noqa: E731
    torch.testing.assert_close(chunk_mass(freq), chunk_mass(expected.exp()), atol=0.008, rtol=0)  # 5 standard errors
    torch.testing.assert_close(freq, expected.exp(), atol=0.006, rtol=0)  # 5 standard errors of the likeliest token's
    torch.testing.assert_close(log_prob.cpu(), expected[token.cpu()], atol=1e-5, rtol=1e-5)


@gpu
@pytest.mark.parametrize("vocab", [5, 31, 32, 33, 1000, 151936])
def test_the_gpu_greedy_token_is_the_first_maximum_with_the_raw_log_prob(vocab):
    """Greedy on a GPU: each row's first maximum (ties included) and its log-softmax under the raw logits, as the
    CPU's chunked path gives, also where every logit is far below 0."""
    torch.manual_seed(0)
    logits = torch.randn(6, vocab) * 8
    logits[0, [vocab // 3, vocab - 1]] = 100.0
    for x in (logits, logits - 500.0):
        token, log_prob = sample_tokens(x.cuda(), greedy=True, temperature=0.5, top_k=0, top_p=1.0, kernel=True)
        expected_token, expected_log_prob = sample_tokens(x, greedy=True, temperature=0.5, top_k=0, top_p=1.0)
        assert token.cpu().tolist() == expected_token.tolist()
        torch.testing.assert_close(log_prob.cpu(), expected_log_prob, atol=1e-4, rtol=1e-5)


@gpu
def test_the_gpu_draw_repeats_under_a_seed_and_each_graph_replay_draws_anew():
    """The same seed gives the same tokens; a CUDA graph of the draw (as the decode step is) draws new tokens at
    each replay, still from the distribution."""
    logits = torch.zeros(256, 100, device="cuda")

    def draw():
        return sample_tokens(logits, greedy=False, temperature=1.0, top_k=0, top_p=1.0, kernel=True)[0]

    draws = []
    for _ in range(2):
        torch.manual_seed(3)
        draws.append(draw())
    assert torch.equal(*draws)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        draw()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        token = draw()
    replays = []
    for _ in range(200):
        graph.replay()
        replays.append(token.clone())
    replays = torch.stack(replays).cpu()
    assert not torch.equal(replays[0], replays[1])
    freq = torch.bincount(replays.flatten(), minlength=100).float() / replays.numel()
    assert (freq - 0.01).abs().max() < 0.003  # uniform: 51,200 draws over 100 tokens, a standard error of 0.00044
