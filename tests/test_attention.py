"""The project's attention: decoding's grouped heads and packed rows give what SDPA gives."""

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from grpo.process.errors import ModelLoadError
from grpo.training.attention import (PACKED_PLACEHOLDER_MASK_SHAPE, attention, decode_attention, filled_slots_attention,
                                     packed_attention)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a GPU")
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_filled_slot_attention_is_the_dense_attention_under_the_mask(head_dim):
    """bf16 on a GPU: reading each reply's span of filled slots gives what the dense decode attention gives over
    the whole cache under the mask (left padding, slots not written yet), also through an inference-mode
    reply with no padding and one whose span is a single slot; whole or split over programs (a split of the
    1-slot span left with no keys), and at a head size that is no power of two."""
    torch.manual_seed(0)
    batch, q_heads, kv_heads, slots = 5, 14, 2, 96
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    query = torch.randn(batch, q_heads, 1, head_dim, **cuda)
    key, value = torch.randn(batch, kv_heads, slots, head_dim, **cuda), torch.randn(batch, kv_heads, slots, head_dim, **cuda)
    first, last = torch.tensor([0, 3, 40, 7, 60]), torch.tensor([80, 50, 41, 95, 60])  # filled: first..last
    position = torch.arange(slots)
    mask = ((position >= first[:, None]) & (position <= last[:, None]))[:, None, None].cuda()
    starts = (torch.arange(batch * kv_heads).view(batch, kv_heads) * slots + first[:, None]).flatten()
    starts = starts.int().cuda()
    lengths = (last - first + 1).repeat_interleave(kv_heads).int().cuda()
    ours, _ = filled_slots_attention(query, key, value, starts, lengths, scaling=head_dim ** -0.5)
    dense, _ = decode_attention(query, key, value, mask, scaling=head_dim ** -0.5)
    assert ours.shape == dense.shape == (batch, 1, q_heads, head_dim)
    torch.testing.assert_close(ours.float(), dense.float(), atol=2e-2, rtol=2e-2)
    from grpo.training import filled_slots_kernel  # imports Triton: GPU machines only

    flat = query.reshape(batch * q_heads, head_dim)
    for splits in (1, 3, 8):
        split = filled_slots_kernel.filled_slots_attention(flat, key.view(-1, head_dim), value.view(-1, head_dim),
                                                           starts, lengths, q_heads // kv_heads, head_dim ** -0.5,
                                                           splits)
        torch.testing.assert_close(split.view(batch, 1, q_heads, head_dim).float(), dense.float(), atol=2e-2,
                                   rtol=2e-2)


def test_the_filled_slot_kernel_launches_within_the_gpu():
    """Its launch shape from the GPU's numbers: three key blocks in flight where they fit (an H100's 227 KB of shared
    memory per program), fewer where they would not (a consumer card's 99 KB; head size 256 on an A100's 163 KB),
    never none; keys split over more programs only when the pairs are too few for two per multiprocessor."""
    kernel = pytest.importorskip("grpo.training.filled_slots_kernel", reason="Triton comes with CUDA builds of torch")
    h100, a100, consumer = 232448, 166912, 101376
    assert [kernel.stages_for(16, dim, h100) for dim in (64, 128, 256)] == [3, 3, 3]
    assert [kernel.stages_for(16, 128, consumer), kernel.stages_for(16, 256, a100)] == [2, 2]
    assert kernel.stages_for(16, 512, consumer) == 1
    assert [kernel.splits_for(pairs, 132) for pairs in (256, 128, 64, 10)] == [1, 2, 4, 8]
