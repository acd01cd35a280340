"""The attention every model of a run computes with, registered with transformers as ``ATTENTION``:

- packed rows (``packed_cu_seqlens`` among the keyword arguments): each row of real tokens attends causally to
  itself only, by FlashAttention's variable-length kernel on a GPU (``packed_attention``);
- one-token queries (decoding): the query heads of a KV group batched against their shared K/V, reading each
  reply's filled cache slots only where the decode loop passes their bounds (``filled_slots_attention``, a GPU in
  half precision), else every slot under the mask (``decode_attention``);
- anything else: transformers' SDPA.

One function for all three, set once when a model is loaded: where the sampler is the trained model itself (one
GPU, one dtype), generation and training call the same modules, and switching the implementation between them
would recompile the captured decode step.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from grpo.process.errors import ModelLoadError

ATTENTION = "grpo"
# what packed rows pass as the attention mask (transformers returns a 4D mask as it is): no [T, T] mask is built
PACKED_PLACEHOLDER_MASK_SHAPE = (1, 1, 1, 1)


def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if "packed_cu_seqlens" in kwargs:
        return packed_attention(query, key, value, kwargs["packed_cu_seqlens"], kwargs["packed_max_length"], scaling)
    if "filled_kv_starts" in kwargs:
        return filled_slots_attention(query, key, value, kwargs["filled_kv_starts"], kwargs["filled_kv_lengths"],
                                      scaling)
    placeholder = attention_mask is not None and tuple(attention_mask.shape) == PACKED_PLACEHOLDER_MASK_SHAPE
    if placeholder and query.shape[2] > 1:
        # packed rows whose bounds did not get here: SDPA would let every row attend to the rows before it
        raise ModelLoadError(f"{type(module).__name__} got packed rows without their bounds: this model's decoder does "
                             "not pass keyword arguments on to its attention. Set train.packed_sequences=false.")
    if query.shape[2] == 1:
        return decode_attention(query, key, value, attention_mask, scaling)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def use_project_attention(model) -> None:
    model.set_attn_implementation(ATTENTION)


def decode_attention(query, key, value, attention_mask, scaling=None):
    """One-token queries: the cache is read once per KV group and never copied per query head."""
    batch, q_heads, _, head_dim = query.shape
    kv_heads = key.shape[1]
    scaling = head_dim ** -0.5 if scaling is None else scaling
    q = query.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scaling       # [B, kv heads, group, slots]
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, : key.shape[2]]                     # [B, 1, 1, slots]
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    out = torch.matmul(scores.softmax(-1).to(value.dtype), value)           # [B, kv heads, group, head dim]
    return out.reshape(batch, q_heads, 1, head_dim).transpose(1, 2), None


def filled_slots_attention(query, key, value, kv_starts, kv_lengths, scaling=None):
    """One-token queries ``[B, Hq, 1, D]`` against a KV cache ``[B, Hkv, S, D]``, reading only each reply's filled
    slots (``grpo.training.filled_slots_kernel``): each (reply, KV head) pair attends with its group's query heads
    to ``kv_lengths[j]`` tokens from ``kv_starts[j]`` on in the cache read flat, ``[B * Hkv * S]`` tokens of one
    head (``grpo.inference.decoding.filled_slot_bounds``), which skips its prompt's left padding and the slots not
    written yet. The dense path read every slot, filled or not, through two batched GEMMs: about 1 ms of a 1.5B x
    128 decode step's 4 ms on an H100 (benchmarks/README.md). Returns ``[B, 1, Hq, D]``."""
    from grpo.training.filled_slots_kernel import filled_slots_attention as attend  # imports Triton: GPUs only

    batch, q_heads, _, head_dim = query.shape
    scaling = head_dim ** -0.5 if scaling is None else scaling
    out = attend(query.reshape(batch * q_heads, head_dim).contiguous(), key.view(-1, head_dim),
                 value.view(-1, head_dim), kv_starts, kv_lengths, q_heads // key.shape[1], scaling)
    return out.view(batch, q_heads, 1, head_dim).transpose(1, 2), None


def packed_attention(query, key, value, cu_seqlens, max_length: int, scaling=None):
    """``query`` ``[1, Hq, T, D]``, ``key``/``value`` ``[1, Hkv, T, D]``: rows laid end to end, row i the tokens
    ``cu_seqlens[i]:cu_seqlens[i + 1]``, each attending causally within itself. Returns ``[1, T, Hq, D]``.

    On a GPU in half precision: FlashAttention's variable-length kernel (``torch.nn.attention.varlen``), which
    reads no pads. Elsewhere the rows are scattered into a padded batch for SDPA and gathered back: exact, and
    the pads cost only in attention (the CPU, the tests)."""
    # under autocast, as SDPA would: the rotary embedding left q and k in float32
    half = torch.get_autocast_dtype("cuda") if query.is_cuda and torch.is_autocast_enabled("cuda") else query.dtype
    if query.is_cuda and half in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        q, k, v = (x[0].transpose(0, 1).to(half) for x in (query, key, value))  # [T, H, D]; fewer K/V heads: grouped
        out = varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_length, max_length, scale=scaling, window_size=(-1, 0))
        return out[None], None
    total, starts = query.shape[2], cu_seqlens.long()
    # each token's row: the row starts at or before it (a cumulative count; inductor cannot lower searchsorted here)
    row = torch.zeros(total, dtype=torch.long, device=query.device).index_add_(
        0, starts[1:-1], torch.ones_like(starts[1:-1])).cumsum(0)
    col = torch.arange(total, device=query.device) - starts[row]

    def padded(x):  # [1, H, T, D] -> [rows, H, max_length, D], right-padded: causal attention never sees the pads
        out = x.new_zeros(starts.shape[0] - 1, x.shape[1], max_length, x.shape[3])
        out[row, :, col] = x[0].transpose(0, 1)
        return out

    out = torch.nn.functional.scaled_dot_product_attention(padded(query), padded(key), padded(value), is_causal=True,
                                                           scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return out[row, :, col][None], None


AttentionInterface.register(ATTENTION, attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
