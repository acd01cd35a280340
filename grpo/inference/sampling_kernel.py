"""A decode step's next tokens drawn from full-vocabulary logits by two Triton kernels (GPU only; imported where it
runs, where top_k/top_p are off; the retired ``inference_model.sampler_kernel`` switched it off).

Why not the compiled ``grpo.inference.sampling`` alone: inductor makes its logsumexp over the vocabulary chunks one
kernel that reads the logits twice (the maximum, then the sum), then draws within the chosen chunk in a kernel of
its own: 53 us of a 0.5B x 128 decode step's 1,234 us on an H200 (32 + 12 + 5 + a random-number kernel), for 39 MB
of bfloat16 logits that one read at the GPU's bandwidth takes ~10 us. The same two-stage draw here, 15 + 6 us: the
first kernel reads each chunk of a row once (its maximum and sum of exponentials), the second draws a chunk by its
mass, then a token of it by its probability within it, each a Gumbel-max draw, so random numbers are made for one
chunk a row (a Gumbel draw for every token took 131 us: a random number costs more than reading the logit). Greedy:
each chunk's first maximum, then the first chunk's with the largest. A decode call, 128 replies x 512 tokens on an
H200, alternating with the compiled sampler in one process: 0.5B 0.662-0.679 s against 0.676-0.692, 1.5B
1.147-1.153 against 1.158-1.165 (benchmarks/README.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from grpo.training.filled_slots_kernel import gpu_limits

# tokens a chunk: one load a program (16 a thread), ~9.6k programs at 152k tokens x 128 rows; the draw within a
# chunk then makes 2k random numbers a row
CHUNK = 2048


@triton.jit
def scaled_logits(logits_ptr, row, row_stride, tokens, vocab, inv_temperature):
    """Row ``row``'s logits at ``tokens`` times ``inv_temperature``, in float32; -inf past the vocabulary."""
    return (tl.load(logits_ptr + row.to(tl.int64) * row_stride + tokens, mask=tokens < vocab,
                    other=float("-inf")).to(tl.float32) * inv_temperature).to(tl.float32)


@triton.jit
def chunk_sums(logits_ptr, stats_ptr, vocab, row_stride, inv_temperature, CHUNK: tl.constexpr,
               CHUNKS: tl.constexpr, GREEDY: tl.constexpr, PDL: tl.constexpr):
    """Each chunk's maximum scaled logit, the sum of exp(scaled logit - maximum) and (greedy) the first token at it."""
    if PDL:  # launched before the logits' kernel has finished: wait for its writes
        tl.extra.cuda.gdc_wait()
    row, chunk = tl.program_id(0), tl.program_id(1)
    tokens = chunk * CHUNK + tl.arange(0, CHUNK)
    scaled = scaled_logits(logits_ptr, row, row_stride, tokens, vocab, inv_temperature)
    top = tl.max(scaled, 0)  # a chunk always holds a token: the chunks are cdiv(vocab, CHUNK)
    at = (row * CHUNKS + chunk) * 3
    tl.store(stats_ptr + at, top)
    tl.store(stats_ptr + at + 1, tl.sum(tl.exp(scaled - top), 0))
    if GREEDY:
        tl.store(stats_ptr + at + 2, (chunk * CHUNK + tl.argmax(scaled, 0, tie_break_left=True)).to(tl.float32))


@triton.jit
def draw_in_chunk(logits_ptr, stats_ptr, seed_ptr, token_ptr, log_prob_ptr, vocab, row_stride, inv_temperature,
                  CHUNK: tl.constexpr, CHUNKS: tl.constexpr, CHUNKS_PAD: tl.constexpr, GREEDY: tl.constexpr,
                  PDL: tl.constexpr):
    if PDL:  # launched before the chunks' sums are written: wait for them
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    chunks = tl.arange(0, CHUNKS_PAD)
    at = (row * CHUNKS + chunks) * 3
    tops = tl.load(stats_ptr + at, mask=chunks < CHUNKS, other=float("-inf"))
    totals = tl.load(stats_ptr + at + 1, mask=chunks < CHUNKS, other=0.0)
    top = tl.max(tops, 0)
    log_total = top + tl.log(tl.sum(tl.where(tops == float("-inf"), 0.0, totals * tl.exp(tops - top)), 0))
    if GREEDY:
        pick = chunks == tl.argmax(tops, 0, tie_break_left=True)  # the first chunk at the maximum
        token = tl.sum(tl.where(pick, tl.load(stats_ptr + at + 2, mask=chunks < CHUNKS, other=0.0), 0.0), 0)
        logit = top
    else:
        seed = tl.load(seed_ptr)
        # a chunk by its mass (-inf where it has none: never drawn) ...
        log_mass = tl.where(tops == float("-inf"), float("-inf"), tops + tl.log(totals))
        chunk = tl.argmax(log_mass - tl.log(-tl.log(tl.rand(seed, row * CHUNKS_PAD + chunks))), 0)
        # ... then a token of it by its probability within it (the random numbers' offsets after the chunks')
        lanes = tl.arange(0, CHUNK)
        tokens = chunk * CHUNK + lanes
        scaled = scaled_logits(logits_ptr, row, row_stride, tokens, vocab, inv_temperature)
        uniform = tl.rand(seed, tl.num_programs(0) * CHUNKS_PAD + row * CHUNK + lanes)
        keys = scaled - tl.log(-tl.log(uniform))  # uniform 0, or a token past the vocabulary: -inf, never drawn
        best = tl.argmax(keys, 0)
        token = chunk * CHUNK + best
        logit = tl.sum(tl.where(lanes == best, scaled, 0.0), 0)
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(log_prob_ptr + row, logit - log_total)


# opaque to torch.compile, as the attention kernel: nothing around it to fuse
@torch.library.custom_op("grpo::draw_tokens", mutates_args=())
def draw_tokens(logits: torch.Tensor, inv_temperature: float, greedy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[B, V]`` (rows contiguous): each row's token drawn from softmax(logits * ``inv_temperature``)
    (``greedy``: its first maximum) and the token's log-prob under it. Returns (``[B]`` int64, ``[B]`` float32)."""
    rows, vocab = logits.shape
    chunks = triton.cdiv(vocab, CHUNK)
    stats = logits.new_empty((rows, chunks, 3), dtype=torch.float32)  # a chunk's maximum, sum and first maximum
    # one seed a call from torch's generator: reproducible under torch.manual_seed, and each replay of a CUDA graph
    # draws a new one (the generator's offset advances at every replay)
    seed = torch.randint(2 ** 31 - 1, (1,), device=logits.device, dtype=torch.int64)
    token = logits.new_empty(rows, dtype=torch.int64)
    log_prob = logits.new_empty(rows, dtype=torch.float32)
    pdl = gpu_limits(logits.device.index)[2]  # as the decode step's other kernels
    with torch.cuda.device(logits.device):
        chunk_sums[(rows, chunks)](logits, stats, vocab, logits.stride(0), inv_temperature, CHUNK=CHUNK,
                                   CHUNKS=chunks, GREEDY=greedy, PDL=pdl, num_warps=4, launch_pdl=pdl)
        draw_in_chunk[(rows,)](logits, stats, seed, token, log_prob, vocab, logits.stride(0), inv_temperature,
                               CHUNK=CHUNK, CHUNKS=chunks, CHUNKS_PAD=triton.next_power_of_2(chunks), GREEDY=greedy,
                               PDL=pdl, num_warps=4, launch_pdl=pdl)
    return token, log_prob


@draw_tokens.register_fake
def draw_tokens_shape(logits, inv_temperature, greedy):
    rows = logits.shape[0]
    return logits.new_empty(rows, dtype=torch.int64), logits.new_empty(rows, dtype=torch.float32)
