"""The decode loop's KV cache: transformers' static cache, written at the loop's slot, and its rows copied between
caches (a compacted batch's, a prefill's of each distinct prompt)."""

from __future__ import annotations

import inspect

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer


class SlotLayer(StaticLayer):
    """transformers' static cache layer, except that a one-token update is written at ``slot``, a tensor every layer
    of the cache shares with the decode loop. The stock layer works the slot out from a counter of its own: an arange
    and an add a layer and token, 56 of a 1.5B decode step's 418 kernels on an H100."""

    slot: torch.Tensor

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.shape[-2] != 1 or not self.is_initialized:  # a prefill, or the tensors not allocated yet
            return super().update(key_states, value_states, *args, **kwargs)
        self.keys.index_copy_(2, self.slot, key_states)
        self.values.index_copy_(2, self.slot, value_states)
        return self.keys, self.values

    def get_seq_length(self):
        """The slot the next token goes to: where transformers (5.24) starts the query's causal mask."""
        return self.slot[0] if self.is_initialized else 0


def slot_cache(config, slots: int, device) -> StaticCache:
    """A ``StaticCache`` of ``slots`` slots whose full-attention layers write one-token updates at ``cache.slot``."""
    cache = StaticCache(config=config, max_cache_len=slots)
    cache.slot = torch.zeros(1, dtype=torch.long, device=device)
    for layer in cache.layers:
        if type(layer) is StaticLayer:  # sliding-window layers keep their own bookkeeping
            layer.__class__, layer.slot = SlotLayer, cache.slot
    return cache


def cache_argument(model) -> str:
    """The name ``forward`` takes the KV cache under: transformers 5.24 renamed ``past_key_values`` to ``cache``
    (the old name warns); the GPU machines run 5.17."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def copy_cache_rows(src: StaticCache, dst: StaticCache, rows: torch.Tensor, slots: int, first: int = 0) -> None:
    """``dst``'s rows become ``src``'s rows ``rows``, in that order: their ``slots`` slots from ``first`` on become
    ``dst``'s first ``slots``."""
    for src_layer, dst_layer in zip(src.layers, dst.layers, strict=True):
        dst_layer.keys[:, :, :slots] = src_layer.keys[rows, :, first:first + slots]
        dst_layer.values[:, :, :slots] = src_layer.values[rows, :, first:first + slots]
        dst_layer.cumulative_length.copy_(src_layer.cumulative_length - first)  # where a layer not at ``slot`` writes


def place_cache_rows(src: StaticCache, dst: StaticCache, rows: torch.Tensor, at: int) -> None:
    """``src``'s first ``len(rows)`` rows, every slot, written to ``dst``'s rows ``rows`` from slot ``at`` on (a
    later turn's context joining a decode batch, ``grpo.inference.turn_streaming``)."""
    for src_layer, dst_layer in zip(src.layers, dst.layers, strict=True):
        width = src_layer.keys.shape[2]
        dst_layer.keys[rows, :, at:at + width] = src_layer.keys[:len(rows)]
        dst_layer.values[rows, :, at:at + width] = src_layer.values[:len(rows)]
