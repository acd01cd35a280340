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
from torch.nn.utils.rnn import pad_sequence
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


def extend_forward(model, cache_name: str, cache: StaticCache, input_ids, positions, attention_mask, start: int):
    """The keys and values of ``input_ids`` written to ``cache`` from slot ``start`` on, its queries attending to
    the slots before it that ``attention_mask`` holds (the logits are not wanted)."""
    for layer in cache.layers:  # the stock layers write at their running length, a one-token forward at the slot
        layer.cumulative_length.fill_(start)
    cache.slot.fill_(start)
    width = input_ids.shape[1]
    model(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask, use_cache=True,
          cache_position=torch.arange(start, start + width, device=input_ids.device),
          logits_to_keep=torch.tensor([width - 1], device=input_ids.device), **{cache_name: cache})  # as prefill_forward


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
        cache = self.scratch_cache(prompts, width, like)
        if self.compiled:
            self._caches[prompts, width] = cache
        return cache

    def scratch_cache(self, prompts: int, width: int, like: StaticCache) -> StaticCache:
        """A cache of ``prompts`` rows x ``width`` slots, its tensors allocated as ``like``'s are, never kept."""
        cache = slot_cache(self.model.config, width, self.model.device)
        for layer, model_layer in zip(cache.layers, like.layers, strict=True):
            keys, values = model_layer.keys, model_layer.values
            layer.lazy_initialization(keys.new_empty(prompts, keys.shape[1], 0, keys.shape[3]),
                                      values.new_empty(prompts, values.shape[1], 0, values.shape[3]))
        return cache

    @torch.no_grad()
    def extend_rows(self, cache: StaticCache, rows: list[int], firsts: list[int], held: list[int],
                    added: list[torch.Tensor], end: int) -> None:
        """Contexts whose first ``held[j]`` tokens row ``rows[j]`` of ``cache`` holds from slot ``firsts[j]`` on, and
        ``added[j]`` after them: each written back to its row so that it ends just before slot ``end``, only the added
        tokens run through the model (episodes' next turns joining a decode batch in the rows their last turns
        decoded in, ``grpo.inference.turn_streaming``: a tool's output and the template around it, not the whole
        context again). Run in a scratch cache: row ``j``'s held tokens end at slot ``width`` (their longest), its
        added ones follow, right-padded, so that every row's added tokens start at one slot."""
        device, count = cache.layers[0].keys.device, len(rows)
        held_n, added_n = torch.tensor(held), torch.tensor([len(a) for a in added])
        width, extra = int(held_n.max()), int(added_n.max())
        # the scratch's slot k of row j: held slot firsts[j] + k - (width - held[j]); the pads before repeat the first
        lead = width - held_n
        read = torch.tensor(firsts)[:, None] + (torch.arange(width)[None] - lead[:, None]).clamp_min(0)
        row_index, read = torch.tensor(rows, device=device)[:, None], read.to(device)
        scratch = self.scratch_cache(count, width + extra, cache)  # one shape a join: not kept
        for layer, model_layer in zip(scratch.layers, cache.layers, strict=True):
            layer.keys[:, :, :width] = model_layer.keys[row_index, :, read].transpose(1, 2)
            layer.values[:, :, :width] = model_layer.values[row_index, :, read].transpose(1, 2)
        if extra:
            columns = torch.arange(width + extra)[None]
            mask = (columns >= lead[:, None]) & (columns < width + added_n[:, None])
            extend_forward(self.model, self.cache_name, scratch, pad_sequence(added, batch_first=True).to(device),
                           (held_n[:, None] + torch.arange(extra)[None]).to(device), mask.long().to(device), width)
        # back to each row, ending at slot ``end``; a shorter context's pads repeat its last slot (the same value)
        total = held_n + added_n
        k = torch.minimum(torch.arange(int(total.max()))[None], (total - 1)[:, None])
        source, target = (lead[:, None] + k).to(device), (end - total[:, None] + k).to(device)
        scratch_rows = torch.arange(count, device=device)[:, None]
        for layer, model_layer in zip(scratch.layers, cache.layers, strict=True):
            model_layer.keys[row_index, :, target] = layer.keys[scratch_rows, :, source]
            model_layer.values[row_index, :, target] = layer.values[scratch_rows, :, source]

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
