"""Drawing each decode step's next token from a batch of full-vocabulary logits, with its log-prob.

Part of the decode step that ``grpo.inference.decoding`` captures as one CUDA graph: no host synchronisation.
"""

from __future__ import annotations

import torch

# a decode batch has few rows and a long vocabulary. Reduced a row at a time, the sampler's passes over 128 x 152k
# logits (one Gumbel draw a token among them) took 210 us of a 1.5B decode step's 3.8 ms on an H100
VOCAB_CHUNKS = 32


def sample_tokens(logits, *, greedy: bool, temperature: float, top_k: int, top_p: float, kernel: bool = False):
    """The next token of each row and its log-prob under the distribution it was drawn from: softmax of
    the logits / temperature, cut by top-k/top-p (as vLLM's ``processed_logprobs``); greedy: the raw logits'.

    A draw is exact in two stages: a vocabulary chunk by its probability mass, then a token of that chunk by
    its probability within it (each a Gumbel-max draw). So random numbers are drawn for one chunk a row, not
    for the whole vocabulary. ``kernel``: on a GPU, without top-k/top-p, the same draw by two Triton kernels
    (``grpo.inference.sampling_kernel``), which read the logits once."""
    if kernel and logits.is_cuda and not top_k and top_p >= 1.0:
        from grpo.inference.sampling_kernel import draw_tokens  # imports Triton: GPUs only

        return draw_tokens(logits.contiguous(), 1.0 if greedy else 1.0 / temperature, greedy)
    logits = logits.float()
    if not greedy:
        logits = logits / temperature
        keep = kept_tokens(logits, top_k, top_p)
        if keep is not None:
            logits = logits.masked_fill(~keep, float("-inf"))
    chunks = vocab_chunks(logits)
    log_mass = chunks.logsumexp(-1)  # each chunk's; -inf where top-k/top-p or the padding left none
    if greedy:
        token = chunked_argmax(chunks)
    else:
        chunk = gumbel_argmax(log_mass)
        inside = chunks.gather(1, chunk[:, None, None].expand(-1, 1, chunks.shape[-1]))[:, 0]
        token = chunk * chunks.shape[-1] + gumbel_argmax(inside)
    log_prob = logits.gather(-1, token[:, None])[:, 0] - log_mass.logsumexp(-1)
    return token, log_prob


def kept_tokens(logits, top_k: int, top_p: float):
    """Where top-k, then top-p over what top-k kept, leave tempered ``logits`` ``[N, V]`` drawable; None when both are
    off. The trainer cuts its logits here too (``grpo.training.logprobs``), so both score one distribution."""
    if not top_k and top_p >= 1.0:
        return None
    keep = torch.ones_like(logits, dtype=torch.bool)
    if top_k:
        keep = logits >= logits.topk(top_k, dim=-1).values[:, -1:]
    if top_p < 1.0:
        ordered, order = logits.masked_fill(~keep, float("-inf")).sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        in_nucleus = probs.cumsum(-1) - probs <= top_p  # the mass before each token; the top token always stays
        keep = keep & torch.zeros_like(keep).scatter(-1, order, in_nucleus)
    return keep


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
