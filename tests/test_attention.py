"""The project's attention: decoding's grouped heads and packed rows give what SDPA gives."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from grpo.process.errors import ModelLoadError
from grpo.training.attention import PACKED_PLACEHOLDER_MASK_SHAPE, attention, decode_attention, packed_attention


def sdpa_module(q_heads: int, kv_heads: int) -> torch.nn.Module:
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = q_heads // kv_heads, True, False
    return module


def test_decode_attention_equals_sdpa_with_grouped_heads_and_padding():
    torch.manual_seed(0)
    batch, q_heads, kv_heads, slots, head_dim = 3, 6, 2, 10, 8
    query = torch.randn(batch, q_heads, 1, head_dim)
    key, value = torch.randn(batch, kv_heads, slots, head_dim), torch.randn(batch, kv_heads, slots, head_dim)
    mask = torch.ones(batch, 1, 1, slots, dtype=torch.bool)
    mask[0, ..., :3] = False  # left padding
    mask[1, ..., 7:] = False  # slots not written yet
    ours, _ = decode_attention(query, key, value, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(sdpa_module(q_heads, kv_heads), query, key, value, mask, scaling=0.3)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_packed_rows_attend_causally_within_themselves_only():
    """Rows of 5, 1 and 9 tokens end to end: each row's output is SDPA's over that row alone, grouped K/V heads
    included; a row that attended across its start would differ."""
    torch.manual_seed(0)
    lengths, q_heads, kv_heads, head_dim = [5, 1, 9], 6, 2, 8
    total = sum(lengths)
    query = torch.randn(1, q_heads, total, head_dim)
    key, value = torch.randn(1, kv_heads, total, head_dim), torch.randn(1, kv_heads, total, head_dim)
    cu_seqlens = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    ours, _ = packed_attention(query, key, value, cu_seqlens, max(lengths), scaling=0.3)
    assert ours.shape == (1, total, q_heads, head_dim)
    module = sdpa_module(q_heads, kv_heads)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        theirs, _ = sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                                           None, scaling=0.3, is_causal=True)
        torch.testing.assert_close(ours[:, start:end], theirs, atol=1e-5, rtol=1e-5)
    whole, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3, is_causal=True)
    assert not torch.allclose(ours[:, 6:], whole[:, 6:], atol=1e-3)


def test_packed_rows_without_their_bounds_are_refused():
    """A decoder that drops its keyword arguments would hand the packed rows to SDPA with the placeholder mask, and
    every row would attend to the rows before it: one line instead."""
    query = key = value = torch.randn(1, 2, 6, 4)
    placeholder = torch.ones(PACKED_PLACEHOLDER_MASK_SHAPE, dtype=torch.bool)
    with pytest.raises(ModelLoadError, match="packed rows without their bounds.*train.packed_sequences=false"):
        attention(sdpa_module(2, 2), query, key, value, placeholder)
