"""Sampling replies from a Hugging Face causal LM: the transformers backend's own decode loop.

``model.generate`` ran rollouts at 3.8% of the memory-bandwidth bound on an H100 (1.5B shape, 64
replies x 512 tokens, 26.9 ms per token): its static cache is sized once for ``max_model_len`` so
every step attends over 2048 slots; with a padding mask, transformers' SDPA path copies K and V
once per query head (GQA) inside a compiled step; and ``output_logits`` keeps float32
full-vocabulary logits for every generated token (47 GB peak). This loop instead:

- sizes the KV cache to the batch's need (longest prompt + ``max_new_tokens``), rounded up to
  ``cache_bucket`` tokens so the compiled step is reused across batches;
- reads each K/V head once for its group of query heads when decoding, and on a GPU in half precision only each
  reply's filled cache slots (``grpo.training.filled_slots_kernel``);
- runs each layer's q/k/v and gate/up projections as one GEMM each (``grpo.inference.fused_projections``: 23.8% ->
  25.8% of the bound at 1.5B x 128 on an H100), in a policy it shares (``fuse_shared``) from copies while it samples;
- keeps only the sampled token's log-prob (of the tempered distribution it was drawn from: what the trainer scores),
  drawing the token in two stages (``grpo.inference.sampling``: random numbers for one vocabulary chunk a row; on a
  GPU by two Triton kernels, ``grpo.inference.sampling_kernel``);
- prefills a prompt the batch repeats (a GRPO group's) once, and copies its KV-cache rows (``grpo.inference.prefill``),
  compiled on a GPU where asked (``compile_prefill``);
- runs each decode step (forward, sampling, bookkeeping) as one CUDA-graph replay (single GPU), each kernel launched
  while the one before it finishes (``DECODE_COMPILE_OPTIONS``);
- lets rows whose reply has ended leave the batch (``compact_rows``): the batch halves whenever the rows
  still decoding fit in half of it, so a long tail of replies no longer decodes the whole batch;
- stops once every reply has ended.
"""

from __future__ import annotations

import contextlib
import time

import torch
from transformers import StaticCache

from grpo.inference.fused_projections import FusedWhileSampling, fuse_projections
from grpo.inference.kv_cache import SlotLayer, cache_argument, copy_cache_rows, slot_cache
from grpo.inference.prefill import PREFILL_BUCKET, Prefill
from grpo.inference.sampling import sample_tokens
from grpo.training.attention import use_project_attention

# counting the rows still decoding waits for the GPU; checking every few tokens keeps the CPU ahead of the GPU
STOP_CHECK_EVERY = 8
# the batch halves no further: below it a decode step costs about the same on a GPU (latency-bound: 1.5B on an
# H100, 128 rows took 1.28x the time of 64), and each batch size is one more compiled graph
SMALLEST_COMPACTED_BATCH = 16
# each batch size (and sampling mode) is one more entry of the decode step's compiled code; dynamo's default of 8
# would fall back to uncompiled kernels past it
DECODE_RECOMPILE_LIMIT = 64
# inductor's options for the decode step, each worth it at 0.5B x 128 where the step is ~300 short kernels (one H100,
# bench_generation, one invocation each against 20.0% of the bound): programmatic dependent launch, each Triton kernel
# launched while the one before it finishes (Hopper on; 21.6%), and combo kernels, independent pointwise kernels such
# as the rotary embedding of q and of k as one launch (20.9%). The dependent launches pay only in the first CUDA graph
# a process captures: one H200, 0.5B x 128, a step 1,138 us, after any other capture 1,247 (off: 1,237 either way)
DECODE_COMPILE_OPTIONS = {"combo_kernels": True}
if hasattr(torch._inductor.config.triton, "enable_pdl"):  # an older torch (the project takes 2.6 on) lacks it
    DECODE_COMPILE_OPTIONS["triton.enable_pdl"] = True
# the options TorchRL's wrapper adds to every generate call; this loop returns what they ask for
TORCHRL_GENERATE_OPTIONS = {"tokenizer", "output_logits", "return_dict_in_generate", "num_return_sequences"}


class DecodeBuffers:
    """What one decode step reads and advances in place. Fixed addresses: a CUDA graph replays the step."""

    def __init__(self, batch: int, slots: int, max_new_tokens: int, stop_ids: list[int], slot: torch.Tensor):
        device = slot.device
        self.last_token = torch.zeros(batch, dtype=torch.long, device=device)
        self.position = torch.zeros(batch, 1, dtype=torch.long, device=device)  # of the next token, per reply
        self.slot = slot                                                        # its KV-cache slot: the cache's
        self.mask = torch.zeros(batch, slots, dtype=torch.long, device=device)  # slots each reply attends to
        self.first_slot = torch.zeros(batch, dtype=torch.long, device=device)   # its first: after the left padding
        self.done = torch.zeros(batch, dtype=torch.bool, device=device)
        self.step = torch.zeros(1, dtype=torch.long, device=device)
        self.tokens = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
        self.log_probs = torch.zeros(batch, max_new_tokens, device=device)
        self.stop_ids = torch.tensor(stop_ids, device=device)


def record(buf: DecodeBuffers, token, log_prob, pad_token_id: int) -> None:
    """Store a sampled token (the pad once its reply has ended) and its log-prob."""
    token = token.masked_fill(buf.done, pad_token_id)
    buf.tokens.index_copy_(1, buf.step, token[:, None])
    buf.log_probs.index_copy_(1, buf.step, log_prob.masked_fill(buf.done, 0.0)[:, None])
    buf.done.logical_or_(torch.isin(token, buf.stop_ids))
    buf.last_token.copy_(token)
    buf.step.add_(1)


def compacted_size(batch: int, active: int) -> int | None:
    """The batch the ``active`` rows of a ``batch``-row decode move to: the smallest halving of it (not below
    ``SMALLEST_COMPACTED_BATCH``) that holds them, when there is one; else None."""
    size = batch
    while size // 2 >= max(active, SMALLEST_COMPACTED_BATCH):
        size //= 2
    return size if size < batch else None


# With CUDA graphs each decode shape (rows, KV-cache slots) is one more compiled graph, and a multi-turn batch's later
# turns sample any number of episodes with a longer context each turn: rounded to a multiple of 32 rows and of the
# cache bucket, the real 0.5B with the tool on an H200 compiled 8, 3, 1, 1, 4 graphs in its first steps (26-96 s a
# step, not 6-9). Rounded to powers of two, the rows hit the sizes row compaction halves to and a cache grows at most
# log2 times.
def graphed_rows(rows: int) -> int:
    """The decode batch ``rows`` replies run in under CUDA graphs: a power of two, ``SMALLEST_COMPACTED_BATCH`` or
    more."""
    return max(SMALLEST_COMPACTED_BATCH, 1 << (rows - 1).bit_length())


def graphed_slots(length: int, cache_bucket: int) -> int:
    """The KV-cache slots for ``length`` tokens (prompt and reply) under CUDA graphs: ``cache_bucket`` times a power
    of two."""
    return cache_bucket << (-(-length // cache_bucket) - 1).bit_length()


def move_rows(src: DecodeBuffers, src_cache: StaticCache, dst: DecodeBuffers, dst_cache: StaticCache,
              rows: torch.Tensor, active: int) -> None:
    """Carry decode rows ``rows`` of ``src`` (and their KV cache) into ``dst``, in that order: its first ``active``
    rows go on decoding; the rest repeat a live row (never attend to nothing) and are marked done (emit pad)."""
    slots = src.mask.shape[1]
    dst.mask.zero_()
    dst.mask[:, :slots] = src.mask[rows]
    for name in ("last_token", "position", "first_slot", "done", "tokens", "log_probs"):
        getattr(dst, name).copy_(getattr(src, name)[rows])
    dst.done[active:] = True
    dst.step.copy_(src.step)
    dst.slot.copy_(src.slot)
    copy_cache_rows(src_cache, dst_cache, rows, slots)


def filled_slot_bounds(buf: DecodeBuffers, kv_heads: int) -> dict[str, torch.Tensor]:
    """Where each (reply, KV head) pair's filled slots lie in a ``[B, kv_heads, S, D]`` cache read flat, the
    slot being written this step included (``grpo.training.attention.filled_slots_attention``): from its first
    slot after the prompt's left padding, up to and including ``buf.slot``. Once a step, not per layer."""
    batch, slots = buf.mask.shape
    pairs = torch.arange(batch * kv_heads, device=buf.mask.device).view(batch, kv_heads)
    starts = (pairs * slots + buf.first_slot[:, None]).flatten()
    lengths = (buf.slot + 1 - buf.first_slot).repeat_interleave(kv_heads)
    return {"filled_kv_starts": starts.int(), "filled_kv_lengths": lengths.int()}


def decode_step(model, cache, cache_name: str, buf: DecodeBuffers, pad_token_id: int, sampling: dict,
                kv_heads: int | None = None) -> None:
    """Feed the last token, sample the next: one replayable step, no host synchronisation. ``kv_heads``: the
    attention reads only the filled slots (``filled_slot_bounds``); None: every slot under the mask."""
    buf.mask.index_fill_(1, buf.slot, 1)
    filled = filled_slot_bounds(buf, kv_heads) if kv_heads else {}
    logits = model(input_ids=buf.last_token[:, None], position_ids=buf.position, cache_position=buf.slot,
                   attention_mask=buf.mask, use_cache=True, logits_to_keep=1, **{cache_name: cache},
                   **filled).logits[:, -1]
    record(buf, *sample_tokens(logits, **sampling), pad_token_id)
    buf.position.add_(1)
    buf.slot.add_(1)


class ReplySampler(torch.nn.Module):
    """What the transformers engine's episode policy (``grpo.inference.episode_policy``) calls ``generate`` on: samples replies with ``model``,
    returned as ``sequences`` (the prompts' ids, then the replies') and ``log_probs`` (each sampled token's, [B, T]).

    ``compile``: on a single CUDA device, the decode step (forward, sampler, bookkeeping) is compiled
    and captured as one CUDA graph, so a token costs one replay and no Python. torch.compile's own
    "reduce-overhead" mode graphed the forward alone; the guards, sampler and bookkeeping around it
    kept 2.4 ms of host work per token (0.5B, 64 replies, H100: 14% of the bound).
    On the CPU the same step runs eagerly.

    ``compact_rows``: when the rows still decoding fit in half the batch, they move to a batch half the size
    (``compacted_size``), with their KV cache; each size has its own cache and step, built once and kept.
    ``fuse_shared``: a model that trains too samples through fused copies (``FusedWhileSampling``).

    ``compile_prefill``: with ``compile``, the prompts' forward is compiled too (``grpo.inference.prefill``).

    On a GPU, tokens are drawn by Triton kernels (``grpo.inference.sampling_kernel``) where top_k/top_p are off, and
    in half precision decode attention reads each reply's filled cache slots only (a Triton kernel:
    ``filled_slot_bounds``); elsewhere the compiled sampler draws, and attention reads every slot under the mask.
    ``sampler_kernel`` and ``kv_heads`` (None: every slot) are what the GPU tests set to compare the two.
    """

    def __init__(self, model, *, compile: bool, cache_bucket: int, compact_rows: bool, fuse_shared: bool = True,
                 compile_prefill: bool = False):
        super().__init__()
        self.model = model
        self.cache_bucket = cache_bucket
        self.compact_rows = compact_rows
        self.sampler_kernel = True
        self.batch_sizes: list[int] = []  # the last generate call's decode batches, first to last
        self.seconds = 0.0  # in generate calls so far, until their replies were on the GPU
        self.cache_name = cache_argument(model)
        use_project_attention(model)
        trained = any(p.requires_grad for p in model.parameters())
        if not trained:  # an inference copy
            fuse_projections(model)
        self.fusion = FusedWhileSampling(model) if trained and fuse_shared else None  # the policy itself
        param = next(model.parameters())
        self.graphed = compile and param.device.type == "cuda"
        compiled_prefill = self.graphed and compile_prefill
        self.prefill = Prefill(model, self.cache_name, bucket=PREFILL_BUCKET if compiled_prefill else 1,
                               compile=compiled_prefill)
        half = param.device.type == "cuda" and param.dtype in (torch.float16, torch.bfloat16)
        text = model.config.get_text_config()
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads  # no GQA: one per head
        self.kv_heads = kv_heads if half else None
        # per batch size: (slots, cache); it only grows, since its graphs are bound to its tensors
        self._caches: dict[int, tuple[int, StaticCache]] = {}
        self._steps: dict[tuple, tuple[DecodeBuffers, callable]] = {}

    def slot_layers_only(self) -> bool:
        """Whether every layer's cache slot is a position (no sliding-window layer): what a turn joining a decode
        batch at its shared slot needs (``grpo.inference.turn_streaming``)."""
        return all(type(layer) is SlotLayer for layer in slot_cache(self.model.config, 1, self.model.device).layers)

    def kv_cache(self, batch: int, length: int) -> tuple[int, StaticCache]:
        needed = (graphed_slots(length, self.cache_bucket) if self.graphed
                  else -(-length // self.cache_bucket) * self.cache_bucket)
        if batch not in self._caches or self._caches[batch][0] < needed:
            self._caches.pop(batch, None)  # free the old cache and its graphs before allocating the next
            self._steps = {key: value for key, value in self._steps.items() if key[0] != batch}
            self._caches[batch] = (needed, slot_cache(self.model.config, needed, self.model.device))
        return self._caches[batch]

    def decode_step_for(self, batch, slots, cache, max_new_tokens, stop_ids, pad_token_id, sampling):
        """The buffers and the step function for this shape and these options, built once."""
        key = (batch, slots, max_new_tokens, tuple(stop_ids), pad_token_id, tuple(sampling.items()))
        if key in self._steps:
            return self._steps[key]
        buf = DecodeBuffers(batch, slots, max_new_tokens, stop_ids, cache.slot)
        args = (self.model, cache, self.cache_name, buf, pad_token_id, sampling, self.kv_heads)
        step = lambda: decode_step(*args)  # noqa: E731
        # building samples tokens it throws away: the run's random stream must not depend on when it happens
        # (a resumed run builds at another step than an uninterrupted one)
        with torch.random.fork_rng(devices=[self.model.device] if self.graphed else []):
            decode_step(*args)  # eager first: the cache allocates its tensors outside any graph
            if self.graphed:
                step = self.capture(args)
        self._steps[key] = (buf, step)
        return buf, step

    @staticmethod
    def capture(args) -> callable:
        """``decode_step(*args)`` compiled (fused kernels) and captured as one CUDA graph: its replay.

        Streams and graphs belong to the current device, so both capture and replay run on the model's:
        an engine on cuda:1 in a process whose current device is cuda:0 failed its capture.
        """
        device = args[0].device
        compiled = torch.compile(decode_step, fullgraph=True, dynamic=False, options=DECODE_COMPILE_OPTIONS)
        with torch.cuda.device(device), torch._dynamo.config.patch(recompile_limit=DECODE_RECOMPILE_LIMIT):
            side = torch.cuda.Stream()  # warm-up (compilation, autotuning) off the capture stream, as CUDA graphs need
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    compiled(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                compiled(*args)

        def replay():
            with torch.cuda.device(device):
                graph.replay()

        return replay

    def sampling(self, *, do_sample: bool, temperature: float, top_p: float, top_k: int) -> dict:
        """The sampler's options (``grpo.inference.sampling.sample_tokens``) for these ``generate`` options."""
        return dict(greedy=not do_sample, temperature=temperature, top_k=top_k, top_p=top_p, kernel=self.sampler_kernel)

    def begin(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, steps: int, stop_ids: list[int],
              pad_token_id: int, sampling: dict) -> tuple[DecodeBuffers, StaticCache, callable]:
        """Left-padded prompts (on the model's device) prefilled and each one's first token sampled: the buffers of
        a decode of up to ``steps`` tokens a row, its cache and its step."""
        attention_mask = attention_mask.to(input_ids.device)
        batch, prompt_len = input_ids.shape
        slots, cache = self.kv_cache(batch, prompt_len + steps)
        buf, step = self.decode_step_for(batch, slots, cache, steps, stop_ids, pad_token_id, sampling)
        buf.mask.zero_()
        buf.mask[:, :prompt_len] = attention_mask
        # the filled slots are read as one span a reply, from its first prompt token on
        if self.kv_heads and not bool((attention_mask.long().diff(dim=-1) >= 0).all()):
            raise ValueError("ReplySampler.generate: the prompts are not left-padded (an attention mask's 0s must all "
                             "come before its 1s): the filled slots are read as one span a reply")
        buf.first_slot.copy_(prompt_len - attention_mask.sum(-1))
        buf.done.zero_()
        buf.step.zero_()
        # rows that leave a compacted batch are not written to again: their reply's rest must already read pad / 0,
        # not the last call's tokens (those put bench_generation's compacted log-probs 0.057 off per token on an H200)
        buf.tokens.fill_(pad_token_id)
        buf.log_probs.zero_()
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        logits = self.prefill(input_ids, positions, attention_mask, cache)
        record(buf, *sample_tokens(logits, **sampling), pad_token_id)
        buf.position.copy_(positions[:, -1:] + 1)
        buf.slot.fill_(prompt_len)
        return buf, cache, step

    def fused(self):
        """The context sampling runs in: a policy that trains samples through its fused copies (``fuse_shared``)."""
        return self.fusion.swapped_in() if self.fusion else contextlib.nullcontext()

    def decode_rows(self, rows: int, batch_rows: int) -> int:
        """The decode batch ``rows`` episodes of a batch of ``batch_rows`` run in: under CUDA graphs rounded up as
        ``graphed_rows`` (each batch size is one more compiled decode graph), never past the batch's own size."""
        return min(graphed_rows(rows), batch_rows) if self.graphed and rows < batch_rows else rows

    @torch.no_grad()
    def generate(self, *args, **kwargs):
        with self.fused():
            return self.sample(*args, **kwargs)

    def sample(self, input_ids, attention_mask, *, max_new_tokens: int, eos_token_id: list[int], pad_token_id: int,
               do_sample: bool, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, **torchrl_options):
        unknown = set(torchrl_options) - TORCHRL_GENERATE_OPTIONS
        if unknown or torchrl_options.get("num_return_sequences", 1) != 1:
            raise ValueError(f"ReplySampler.generate: unsupported options {sorted(unknown) or torchrl_options}")
        start = time.perf_counter()
        home, device = input_ids.device, self.model.device  # replies go back where the prompts came from
        input_ids = input_ids.to(device)
        sampling = self.sampling(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k)
        buf, cache, step = self.begin(input_ids, attention_mask, max_new_tokens, list(eos_token_id), pad_token_id,
                                      sampling)
        # every reply's tokens and log-probs: a compacted batch's rows are written back here when they leave it
        tokens, log_probs = buf.tokens, buf.log_probs
        generated, rows = 1, None  # rows: each decode row's reply, once the batch has been compacted
        self.batch_sizes = [len(buf.done)]
        while generated < max_new_tokens:
            if generated % STOP_CHECK_EVERY == 0:
                active = int(buf.done.logical_not().sum())
                if active == 0:
                    break
                size = compacted_size(len(buf.done), active) if self.compact_rows else None
                if size is not None:
                    if rows is not None:
                        tokens[rows], log_probs[rows] = buf.tokens[:len(rows)], buf.log_probs[:len(rows)]
                    buf, cache, step, rows = self.compact(buf, cache, rows, size, max_new_tokens, list(eos_token_id),
                                                          pad_token_id, sampling)
            step()
            generated += 1
        if rows is not None:
            tokens[rows], log_probs[rows] = buf.tokens[:len(rows)], buf.log_probs[:len(rows)]
        out = {"sequences": torch.cat([input_ids, tokens[:, :generated].to(input_ids.dtype)], dim=1).to(home),
               "log_probs": log_probs[:, :generated].clone().to(home)}  # [B, T]: each sampled token's
        if device.type == "cuda":  # so that self.seconds is the decoding's (a copy to the CPU waits anyway)
            torch.cuda.synchronize(device)
        self.seconds += time.perf_counter() - start
        return out

    def compact(self, buf, cache, rows, size, max_new_tokens, stop_ids, pad_token_id, sampling):
        """The rows still decoding (of replies ``rows``; None: the whole batch's) moved to a batch of ``size``:
        its buffers, cache and step, and the reply of each of its first rows."""
        live = buf.done.logical_not().nonzero()[:, 0]  # a compacted batch's filler rows are done
        slots = buf.mask.shape[1]
        slots_new, cache_new = self.kv_cache(size, slots)  # at least as many slots: the same slot numbers go on
        buf_new, step = self.decode_step_for(size, slots_new, cache_new, max_new_tokens, stop_ids, pad_token_id,
                                             sampling)
        order = torch.cat([live, live[:1].expand(size - len(live))])
        move_rows(buf, cache, buf_new, cache_new, order, len(live))
        self.batch_sizes.append(size)
        return buf_new, cache_new, step, live if rows is None else rows[live]
