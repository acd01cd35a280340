"""Drawing each decode step's next token from a batch of full-vocabulary logits, with its log-prob.

Part of the decode step that ``grpo.inference.decoding`` captures as one CUDA graph: no host synchronisation.
"""

from __future__ import annotations

import torch

# a decode batch has few rows and a long vocabulary. Reduced a row at a time, the sampler's passes over 128 x 152k
# logits (one Gumbel draw a token among them) took 210 us of a 1.5B decode step's 3.8 ms on an H100
VOCAB_CHUNKS = 32


def sample_tokens(logits, *, greedy: bool, temperature: float, top_k: int, top_p: float, kernel: bool = False):
    """The next token of each row, drawn from softmax(logits / temperature) cut by top-k/top-p, and its log-prob
    under softmax(logits / temperature) before the cut; greedy: the raw logits'.

    Before the cut, the log-prob of the policy the trainer scores (``grpo.training.logprobs``): so sampler and
    trainer agree before an update, whatever the cut. The other way, the trainer scoring the cut distribution,
    gives a token drawn from a one-token nucleus log-prob 0 and no gradient, whatever its advantage: at top_p=0.5
    every token of a tiny-model step was such a token (the cut distribution's entropy 0.0). The ratio then leaves
    the cut's own bias uncorrected, as most trainers do.

    A draw is exact in two stages: a vocabulary chunk by its probability mass, then a token of that chunk by
    its probability within it (each a Gumbel-max draw). So random numbers are drawn for one chunk a row, not
    for the whole vocabulary. ``kernel``: on a GPU, without top-k/top-p, the same draw by two Triton kernels
    (``grpo.inference.sampling_kernel``), which read the logits once."""
    if kernel and logits.is_cuda and not top_k and top_p >= 1.0:
        from grpo.inference.sampling_kernel import draw_tokens  # imports Triton: GPUs only

        return draw_tokens(logits.contiguous(), 1.0 if greedy else 1.0 / temperature, greedy)
    scaled = logits.float() if greedy else logits.float() / temperature  # what the log-prob is of: before the cut
    logits = scaled
    cut = not greedy and (top_k or top_p < 1.0)
    if cut:
        if top_k:
            kth = logits.topk(top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            ordered, order = logits.sort(dim=-1, descending=True)
            mass_before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)
            ordered = ordered.masked_fill(mass_before > top_p, float("-inf"))  # the top token always stays
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    chunks = vocab_chunks(logits)
    log_mass = chunks.logsumexp(-1)  # each chunk's; -inf where top-k/top-p or the padding left none
    if greedy:
        token = chunked_argmax(chunks)
    else:
        chunk = gumbel_argmax(log_mass)
        inside = chunks.gather(1, chunk[:, None, None].expand(-1, 1, chunks.shape[-1]))[:, 0]
        token = chunk * chunks.shape[-1] + gumbel_argmax(inside)
    log_total = scaled.logsumexp(-1) if cut else log_mass.logsumexp(-1)
    log_prob = scaled.gather(-1, token[:, None])[:, 0] - log_total
    return token, log_prob


def vocab_chunks(x):
    """``[B, V]`` as ``[B, VOCAB_CHUNKS, ceil(V / VOCAB_CHUNKS)]``, the tail filled with -inf (never drawn)."""
    padded = torch.nn.functional.pad(x, (0, -x.shape[-1] % VOCAB_CHUNKS), value=float("-inf"))
    return padded.view(x.shape[0], VOCAB_CHUNKS, -1)


def gumbel_argmax(log_weights):
    """A draw from softmax(``log_weights``) along the last dim: argmax(log_weights - log E), E ~ Exp(1)."""
    return (log_weights - torch.empty_like(log_weights).exponential_().log()).argmax(-1)


def chunked_argmax(chunks):
    """The first maximum of each row of ``[B, C, L]`` chunks, as an index into the row's vocabulary."""
    best, where = chunks.max(-1)
    chunk = best.argmax(-1, keepdim=True)
    return chunk[:, 0] * chunks.shape[-1] + where.gather(-1, chunk)[:, 0]
