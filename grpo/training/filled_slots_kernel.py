"""Decode attention over each reply's filled KV-cache slots, as a Triton kernel (GPU only; imported where it runs).

Why not FlashAttention's variable-length kernel, which this replaced: it gives each (reply, KV head) pair a tile of
128 query rows, and a decoding pair has only its group's query heads (6 at Qwen2.5-1.5B), so it spends its time on
padding: 26.6 us a layer against 17.2 here for ~50 MB of K/V (1.5B x 128 replies, 377 filled slots; 18.5 against
10.5 us at 0.5B; one H200, benchmarks/README.md). Here a program reads one pair's keys in blocks, its query heads
padded to 16 rows (the smallest tile a tensor-core product takes), the next blocks' loads in flight meanwhile;
with few pairs (a compacted batch) each pair's keys are split over several programs and the parts combined.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# keys a loop iteration and loads in flight: the fastest of 54 tile configs (keys 32/64/128, 2-4 stages, 4/8 warps,
# 1/2/4 splits) at both Qwen2.5 shapes, 128 replies, on an H200
BLOCK_KEYS, STAGES, WARPS = 64, 3, 4
MAX_SPLITS = 8


@triton.jit
def attend_filled_slots(q_ptr, k_ptr, v_ptr, out_ptr, part_ptr, stats_ptr, starts_ptr, lengths_ptr, scale,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        BLOCK: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched before the kernel that wrote the cache has finished: wait for it before any read
        tl.extra.cuda.gdc_wait()
    pair, split = tl.program_id(0), tl.program_id(1)
    heads, dims = tl.arange(0, GROUP_PAD), tl.arange(0, D_PAD)
    dim_ok = dims < D
    q = tl.load(q_ptr + (pair * GROUP + heads)[:, None] * D + dims[None, :],
                mask=(heads < GROUP)[:, None] & dim_ok[None, :], other=0.0)
    start = tl.load(starts_ptr + pair).to(tl.int64)
    length = tl.load(lengths_ptr + pair)
    chunk = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK) * BLOCK  # this split's keys: [lo, hi) of the pair's span
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of each head's scores (base 2)
    total = tl.zeros([GROUP_PAD], tl.float32)               # and its sum of exp2(score - best)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    log2_scale = scale * 1.4426950408889634
    for first in range(lo, hi, BLOCK):
        keys = first + tl.arange(0, BLOCK)
        key_ok = keys < hi
        at = (start + keys)[:, None] * D + dims[None, :]
        k = tl.load(k_ptr + at, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        scores = (tl.dot(q, tl.trans(k)) * log2_scale).to(tl.float32)  # inductor passes the scale in float64
        scores = tl.where(key_ok[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        shrink = tl.exp2(best - new_best)
        weights = tl.exp2(scores - new_best[:, None])
        total = total * shrink + tl.sum(weights, 1)
        v = tl.load(v_ptr + at, mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        acc = acc * shrink[:, None] + tl.dot(weights.to(v.dtype), v)
        best = new_best
    if SPLITS == 1:
        tl.store(out_ptr + (pair * GROUP + heads)[:, None] * D + dims[None, :], (acc / total[:, None]).to(
            out_ptr.dtype.element_ty), mask=(heads < GROUP)[:, None] & dim_ok[None, :])
    else:  # unnormalised, with its max and sum: combine_splits weighs the parts
        row = (pair * SPLITS + split) * GROUP_PAD + heads
        tl.store(part_ptr + row[:, None] * D_PAD + dims[None, :], acc)
        tl.store(stats_ptr + row * 2, best)
        tl.store(stats_ptr + row * 2 + 1, total)


@triton.jit
def combine_splits(out_ptr, part_ptr, stats_ptr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                   D_PAD: tl.constexpr, SPLITS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
    pair = tl.program_id(0)
    heads, dims = tl.arange(0, GROUP_PAD), tl.arange(0, D_PAD)
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for split in tl.static_range(SPLITS):
        best = tl.maximum(best, tl.load(stats_ptr + ((pair * SPLITS + split) * GROUP_PAD + heads) * 2))
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    for split in tl.static_range(SPLITS):
        row = (pair * SPLITS + split) * GROUP_PAD + heads
        part_best = tl.load(stats_ptr + row * 2)
        weight = tl.where(part_best == float("-inf"), 0.0, tl.exp2(part_best - best))  # a split with no keys: 0
        total += weight * tl.load(stats_ptr + row * 2 + 1)
        acc += weight[:, None] * tl.load(part_ptr + row[:, None] * D_PAD + dims[None, :])
    tl.store(out_ptr + (pair * GROUP + heads)[:, None] * D + dims[None, :], (acc / total[:, None]).to(
        out_ptr.dtype.element_ty), mask=(heads < GROUP)[:, None] & (dims < D)[None, :])


def splits_for(pairs: int, processors: int) -> int:
    """Programs a pair's keys are split over: enough for two per multiprocessor (one at 128 replies x 2 KV heads on
    an H100's 132, which was the fastest there), at most ``MAX_SPLITS``."""
    return max(1, min(MAX_SPLITS, 2 * processors // pairs))


def stages_for(group_pad: int, dim_pad: int, shared_memory: int) -> int:
    """Key blocks loaded ahead that fit a program's shared memory: each holds a block of K and one of V (Triton asked
    for exactly its stages' tiles in the GEMMs tried), beside the queries. ``STAGES`` on an H100 or H200 (227 KB),
    fewer on a GPU with less (a consumer card's ~99 KB at head size 128), where ``STAGES`` would not launch."""
    per_stage = 2 * BLOCK_KEYS * dim_pad * 2
    return max(1, min(STAGES, (shared_memory - 2 * group_pad * dim_pad * 2) // per_stage))


@functools.cache
def gpu_limits(index: int) -> tuple[int, int, bool]:
    """(multiprocessors, shared memory a program may use, whether it launches programmatically dependent) of GPU
    ``index``: read once, not at every layer's call. Programmatic dependent launch (Hopper on): a kernel starts
    while the one before it finishes and waits for its writes in the kernel, as the decode step's inductor kernels
    do (``grpo.inference.decoding.DECODE_COMPILE_OPTIONS``); an older Triton has no such launch."""
    properties = triton.runtime.driver.active.utils.get_device_properties(index)
    dependent_launch = torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(tl.extra.cuda, "gdc_wait")
    return properties["multiprocessor_count"], properties["max_shared_mem"], dependent_launch


# opaque to torch.compile (a custom op, not a ``triton_op`` that inductor traces into): it is one tuned kernel already,
# with nothing around it to fuse
@torch.library.custom_op("grpo::filled_slots_attention", mutates_args=())
def filled_slots_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_starts: torch.Tensor,
                           kv_lengths: torch.Tensor, group: int, scale: float, splits: int = 0) -> torch.Tensor:
    """``query`` ``[pairs * group, D]``: each (reply, KV head) pair's query heads, in order; ``key``/``value``
    ``[tokens, D]``: the cache read flat, pair ``j`` attending to ``kv_lengths[j]`` tokens from ``kv_starts[j]``
    on. ``splits``: programs per pair (0: ``splits_for``'s choice). Returns ``[pairs * group, D]``."""
    pairs, head_dim = kv_lengths.shape[0], query.shape[1]
    group_pad, dim_pad = max(16, triton.next_power_of_2(group)), triton.next_power_of_2(head_dim)
    processors, shared_memory, pdl = gpu_limits(query.device.index)
    splits = splits or splits_for(pairs, processors)
    out = torch.empty_like(query)
    parts = query.new_empty((pairs * splits * group_pad, dim_pad) if splits > 1 else (0,), dtype=torch.float32)
    stats = query.new_empty((pairs * splits * group_pad * 2,) if splits > 1 else (0,), dtype=torch.float32)
    with torch.cuda.device(query.device):  # Triton launches on the current device, an engine's may be another
        attend_filled_slots[(pairs, splits)](
            query, key, value, out, parts, stats, kv_starts, kv_lengths, scale, GROUP=group, GROUP_PAD=group_pad,
            D=head_dim, D_PAD=dim_pad, BLOCK=BLOCK_KEYS, SPLITS=splits, PDL=pdl, num_warps=WARPS,
            num_stages=stages_for(group_pad, dim_pad, shared_memory), launch_pdl=pdl)
        if splits > 1:
            combine_splits[(pairs,)](out, parts, stats, GROUP=group, GROUP_PAD=group_pad, D=head_dim, D_PAD=dim_pad,
                                     SPLITS=splits, PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


@filled_slots_attention.register_fake
def filled_slots_attention_shape(query, key, value, kv_starts, kv_lengths, group, scale, splits=0):
    return torch.empty_like(query)
