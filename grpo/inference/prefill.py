"""The prompts' forward pass before decoding: each distinct prompt once, its KV-cache rows then copied to each reply
that repeats it (a GRPO group's replies share a prompt: 16 prompts x 8 replies prefill an eighth of the tokens).

On a GPU the forward can be compiled (``inference_model.compile_prefill``): its first shape as it is, and a second one
with dynamic sizes that every later shape reuses (two compilations a run: ~30 s, then up to ~100 s at 0.5B-1.5B on an
H100 host with a cold compile cache, against ~35 ms saved a generate call). Shapes are then rounded up, to a multiple
of ``PREFILL_BUCKET`` positions (more left padding, which the decode loop skips) and a power of two of prompts, so
that the caches kept for them are few. Run eagerly, transformers' forward launched ~1,400 kernels from Python for
Qwen2.5-0.5B's 16 prompts x 121 tokens: 40 ms of a 760 ms generate call of 128 replies x 512 tokens, against 11 ms of
GPU work (one H100, benchmarks/README.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import StaticCache

from grpo.inference.kv_cache import SlotLayer, copy_cache_rows, place_cache_rows, slot_cache

# positions a compiled prefill's width is rounded up to: GSM8K prompts (~100-300 tokens) fall into a few shapes
PREFILL_BUCKET = 64


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, copy_of)``: the first row of each distinct prompt (ids and mask alike), and each row's index into
    ``rows``. Rows are compared by a random projection, then checked against their pick: ``torch.unique`` over whole
    rows sorted them, 2.4 ms of GPU time at 128 rows x 121 tokens (one H100)."""
    keyed = torch.cat([input_ids.long(), attention_mask.long()], 1)
    # token ids < 2**31 times weights < 2**16, summed over fewer than 2**16 positions: no int64 overflow
    weights = torch.randint(1, 2**16, (keyed.shape[1],), generator=torch.Generator().manual_seed(0))
    hashed = (keyed * weights.to(keyed.device)).sum(1)
    _, copy_of = torch.unique(hashed, return_inverse=True)
    rows = first_rows(copy_of)
    if not torch.equal(keyed[rows][copy_of], keyed):  # two prompts hashed alike: compare the rows themselves
        _, copy_of = torch.unique(keyed, dim=0, return_inverse=True)
        rows = first_rows(copy_of)
    return rows, copy_of


def first_rows(copy_of: torch.Tensor) -> torch.Tensor:
    """The first row of each group, ``copy_of`` giving each row's group."""
    return copy_of.new_full((int(copy_of.max()) + 1,), len(copy_of)).scatter_reduce_(
        0, copy_of, torch.arange(len(copy_of), device=copy_of.device), "amin")


def prefill_forward(model, cache_name: str, cache: StaticCache, input_ids, positions, attention_mask):
    """Each row's last-position logits, its keys and values written to ``cache`` from slot 0."""
    for layer in cache.layers:  # the stock layers write at their running length
        layer.cumulative_length.zero_()
    cache.slot.zero_()  # where a one-token prompt's forward writes, and the causal mask starts
    width = input_ids.shape[1]
    # the last position by index, not ``logits_to_keep=1``: that slice is strided, and cuBLAS ran the LM head on it in
    # 20 ms at 1.5B x 128 on an H100 (a decode step's takes 0.18 ms)
    return model(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask,
                 cache_position=torch.arange(width, device=input_ids.device), use_cache=True,
                 logits_to_keep=torch.tensor([width - 1], device=input_ids.device),
                 **{cache_name: cache}).logits[:, -1]


class Prefill:
    """``prefill(input_ids, positions, attention_mask, cache)``: each left-padded prompt's last-position logits, its
    keys and values written to ``cache``'s first slots. ``bucket``: widths rounded up to a multiple of it and prompts
    to a power of two (1: as given); ``compile``: the forward compiled, the cache of each shape kept for the next
    call."""

    def __init__(self, model, cache_name: str, *, bucket: int, compile: bool):
        self.model, self.cache_name, self.bucket = model, cache_name, bucket
        self.forward = torch.compile(prefill_forward) if compile else prefill_forward
        self.compiled = compile
        self._caches: dict[tuple[int, int], StaticCache] = {}

    def run_cache(self, prompts: int, width: int, like: StaticCache) -> StaticCache:
        """A cache of ``prompts`` rows x ``width`` slots, its layers' heads, head size and dtype those of ``like``'s,
        its tensors allocated here rather than in the forward (a compiled forward would allocate them in its graph).
        Kept per shape when compiled."""
        if (prompts, width) in self._caches:
            return self._caches[prompts, width]
        cache = slot_cache(self.model.config, width, self.model.device)
        for layer, model_layer in zip(cache.layers, like.layers, strict=True):
            keys, values = model_layer.keys, model_layer.values
            layer.lazy_initialization(keys.new_empty(prompts, keys.shape[1], 0, keys.shape[3]),
                                      values.new_empty(prompts, values.shape[1], 0, values.shape[3]))
        if self.compiled:
            self._caches[prompts, width] = cache
        return cache

    @torch.no_grad()
    def __call__(self, input_ids, positions, attention_mask, cache: StaticCache) -> torch.Tensor:
        rows, copy_of = distinct_rows(input_ids, attention_mask)
        width = input_ids.shape[1]
        padded_width, prompts = width, len(rows)
        # a sliding-window layer's slots are not positions: its model's prompts keep their width
        if self.bucket > 1 and all(type(layer) is SlotLayer for layer in cache.layers):
            padded_width, prompts = -(-width // self.bucket) * self.bucket, 1 << (prompts - 1).bit_length()
        rows = torch.cat([rows, rows[:1].expand(prompts - len(rows))])  # filler rows repeat the first prompt
        extra = padded_width - width

        def padded(x):
            return F.pad(x[rows], (extra, 0))  # more left padding: masked out, and the decode loop starts after it

        run_cache = self.run_cache(prompts, padded_width, cache)
        logits = self.forward(self.model, self.cache_name, run_cache, padded(input_ids), padded(positions),
                              padded(attention_mask.long()))
        copy_cache_rows(run_cache, cache, copy_of, width, first=extra)
        return logits[copy_of]

    @torch.no_grad()
    def into_rows(self, input_ids, positions, attention_mask, cache: StaticCache, rows: torch.Tensor, end: int) -> None:
        """Left-padded contexts' keys and values written to ``cache``'s rows ``rows``, each context's last token at
        slot ``end - 1``: episodes' next turns joining a batch that decodes at slot ``end``. Shapes are rounded as
        ``__call__``'s, the filler rows' keys and values dropped."""
        width, count = input_ids.shape[1], len(rows)
        padded_width, prompts = width, count
        if self.bucket > 1:
            padded_width, prompts = min(-(-width // self.bucket) * self.bucket, end), 1 << (count - 1).bit_length()
        picks = torch.cat([torch.arange(count), torch.zeros(prompts - count, dtype=torch.long)]).to(input_ids.device)

        def padded(x):
            return F.pad(x[picks], (padded_width - width, 0))

        run_cache = self.run_cache(prompts, padded_width, cache)
        self.forward(self.model, self.cache_name, run_cache, padded(input_ids), padded(positions),
                     padded(attention_mask.long()))
        place_cache_rows(run_cache, cache, rows, at=end - padded_width)
