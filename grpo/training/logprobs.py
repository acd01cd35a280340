"""Log-probs of reply tokens under a model, in bounded memory: what training, the reference and the
sampler/trainer checks all score replies with. They are the *tempered* policy's, softmax(logits / T) at the
sampling temperature T, the distribution the replies were drawn from, as the samplers record them: the
ratio against the sampler is then 1 before an update whatever T (raw log-probs would differ by the
temperature's reshaping), and the gradient is that of the policy that generates."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch.utils.checkpoint import checkpoint

from grpo.process.world import World
from grpo.training.attention import PACKED_PLACEHOLDER_MASK_SHAPE
from grpo.training.batch import micro_batches
from grpo.training.models import compile_decoder_layers, compiled, compiled_with_grad


class ReplyLogProbs(torch.nn.Module):
    """``token_log_probs`` of one model as a module: what the step scores replies with. A data-parallel
    trainer shards it with this as the root (``World.shard``): ``token_log_probs`` calls the decoder and
    the LM head directly, and only a root's forward gathers the embeddings, final norm and head.

    ``autocast_dtype``: every pass autocasts to it (``mixed_precision_dtype``), so the log-probs a step trains on
    and the ones it scores before its update (importance sampling's) are the same function of the weights. Scored
    in float32 while trained under bf16 autocast, they parted as the float32 weights left the bf16 grid: on the
    real 0.5B (async, H200) the effective sample size fell to 0.31 by step 5 and held-out accuracy to 0.0."""

    def __init__(self, model, temperature: float = 1.0, packed: bool = False,
                 autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.model, self.temperature, self.packed = model, temperature, packed
        self.autocast_dtype = autocast_dtype
        self.head_log_probs = head_log_probs

    def compile_for_training(self) -> None:
        """``train_model.compile``: the decoder layers (one graph for all) and the LM head's log-probs (the
        float32 logits, their logsumexp and gather fused), compiled for the passes that build a graph."""
        compile_decoder_layers(self.model)
        self.head_log_probs = compiled_with_grad(head_log_probs)

    def compile_for_scoring(self) -> None:
        """The same for a model that only scores (the reference, which never generates): every pass compiled."""
        compile_decoder_layers(self.model, compiled)
        self.head_log_probs = compiled(head_log_probs)

    def forward(self, input_ids, attention_mask, width_r: int, *, with_entropy: bool, entropy_grad: bool):
        with torch.autocast(input_ids.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            token_lp, entropy = token_log_probs(self.model, input_ids, attention_mask, width_r,
                                                with_entropy=with_entropy, entropy_grad=entropy_grad,
                                                temperature=self.temperature, head_fn=self.head_log_probs,
                                                packed=self.packed)
        # not views: FSDP2 hooks the root's outputs for backward, and a view would lose the hook on any in-place op
        return token_lp.clone(), entropy if entropy is None else entropy.clone()


@torch.no_grad()
def score_replies(batch: TensorDict, score, s, world: World = World()) -> torch.Tensor:
    """``[S, R]`` log-probs ``score`` (a ``ReplyLogProbs``) gives the replies, in micro-batches cut as
    training's (``s``: the step's ``GRPOSettings``). Each rank of ``world`` scores its share of the rows
    and every rank gets all of them; ``score`` must then not be sharded (ranks may cut differently)."""
    mine = world.share(torch.arange(batch.batch_size[0]))
    out = gathered_scores(queue_scores(batch[mine], score, s), (len(mine), batch["reply_mask"].shape[1]))
    return world.gather_shares(out, batch.batch_size[0]) * batch["reply_mask"]


@torch.no_grad()
def queue_scores(batch: TensorDict, score, s) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each micro-batch's rows and the log-probs ``score`` gives them, left on its device: with packed rows
    nothing here waits for the GPU (the masks stay on the CPU, ``packed_reply_states``), so the forward is queued
    and the CPU goes on (``grpo.training.reference``); ``gathered_scores`` then waits for it."""
    device = next(score.parameters()).device
    queued = []
    for rows, part in micro_batches(batch, s.micro_batch_size, s.micro_batch_tokens, s.packed_sequences):
        lp, _ = score(queued_copy(part["input_ids"], device), part["attention_mask"],
                      part["reply_mask"].shape[1], with_entropy=False, entropy_grad=False)
        queued.append((rows, lp))
    return queued


def gathered_scores(queued: list[tuple[torch.Tensor, torch.Tensor]], shape: tuple[int, int]) -> torch.Tensor:
    """``queue_scores``' log-probs as one ``shape`` CPU tensor (0 past each micro-batch's width)."""
    out = torch.zeros(shape)
    for rows, lp in queued:
        out[rows, :lp.shape[1]] = lp.float().cpu()
    return out


# Logits of at most this many bytes (float32) exist at once: a 152k vocabulary makes [S, R, V] logits
# of 8 replies x 384 tokens 1.9 GB, and their log-softmax and backward several times that (the real
# 0.5B step was killed at 24 GB on CPU with one micro-batch of 8).
LOGIT_CHUNK_BYTES = 2**28
# On a GPU four times that: fewer, larger head matmuls. The 1.5B head over a micro-batch's 8,192 reply tokens,
# forward and backward, 0.042 -> 0.031 s (0.5B: 0.038 -> 0.021 s) for 0.63 GB more at its peak (one H200,
# benchmarks/bench_lm_head.py); 4 GiB gained 2 ms more for 5.5 GB.
GPU_LOGIT_CHUNK_BYTES = 2**30


def token_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, width_r: int, *,
                    with_entropy: bool, entropy_grad: bool, temperature: float = 1.0, head_fn=None,
                    packed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[S, R]`` log pi(reply token | everything before it), and its entropy if asked, where pi is
    softmax(logits / ``temperature``); 0 at the pads of ``packed`` rows.

    The rows go through the decoder dense (``[S, P + R]``, pads included) or ``packed`` (their real tokens end to
    end, ``packed_reply_states``). Only the positions that predict a reply token go through the LM head: the
    prompt positions' logits are never needed; the head runs as ``chunked_head_log_probs``. ``entropy_grad=False``
    keeps the full-vocabulary entropy out of the autograd graph (then it is only logged). ``head_fn`` computes one
    chunk's (``head_log_probs``, or its compiled form).
    """
    states = packed_reply_states if packed else dense_reply_states
    flat_hidden, flat_targets, to_rows = states(model, input_ids, attention_mask, width_r)
    token_lp, entropy = chunked_head_log_probs(model.get_output_embeddings(), flat_hidden, flat_targets,
                                               temperature=temperature, with_entropy=with_entropy,
                                               entropy_grad=entropy_grad, head_fn=head_fn)
    return to_rows(token_lp), entropy if entropy is None else to_rows(entropy)


def chunked_head_log_probs(head, flat_hidden: torch.Tensor, flat_targets: torch.Tensor, *, temperature: float,
                           with_entropy: bool, entropy_grad: bool, head_fn=None,
                           chunk_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The flat targets' log-probs (and entropy) from their flat hidden states, the head run over chunks of positions,
    each under activation checkpointing, so at most ``chunk_bytes`` (default ``LOGIT_CHUNK_BYTES``, on a GPU
    ``GPU_LOGIT_CHUNK_BYTES``) of float32 logits are alive at once, forward or backward; the values are those of one
    full-width pass."""
    entropy_grad = entropy_grad and torch.is_grad_enabled()
    head_fn = head_fn or head_log_probs
    chunk_bytes = chunk_bytes or (GPU_LOGIT_CHUNK_BYTES if flat_hidden.is_cuda else LOGIT_CHUNK_BYTES)
    positions = max(1, chunk_bytes // (4 * head.weight.shape[0]))
    # one chunk, or no backward: nothing to save, so no recompute
    recompute = flat_targets.shape[0] > positions and torch.is_grad_enabled()
    chunks = []
    # one chunk at least: replies that are all empty (a model that samples only stop tokens) score as [S, 0]
    for start in range(0, max(flat_targets.shape[0], 1), positions):
        args = (head, flat_hidden[start:start + positions], flat_targets[start:start + positions], temperature,
                with_entropy, entropy_grad)
        chunks.append(checkpoint(head_fn, *args, use_reentrant=False) if recompute else head_fn(*args))
    token_lp = torch.cat([lp for lp, _ in chunks])
    return token_lp, torch.cat([ent for _, ent in chunks]) if with_entropy else None


def dense_reply_states(model, input_ids, attention_mask, width_r: int):
    """The decoder over the padded rows: the hidden states of the last ``R`` positions before the end, the reply
    tokens they predict (both flat, pads included) and how to put flat values back in ``[S, R]``."""
    attention_mask = attention_mask.to(input_ids.device, non_blocking=True)
    # positions count real tokens only, as in generation from left-padded prompts
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask.long(),
                                 position_ids=position_ids, use_cache=False).last_hidden_state
    hidden = hidden[:, hidden.shape[1] - width_r - 1:-1]
    targets = input_ids[:, input_ids.shape[1] - width_r:]
    return hidden.flatten(0, 1), targets.flatten(), lambda flat: flat.view_as(targets)


def queued_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, the copy queued without the host waiting. From pageable host memory CUDA waits for
    the stream's queued kernels before it copies, so each reference micro-batch's inputs waited for the one before:
    ~0.15 s a step of the 1.5B default job on an H100 host sat in these copies (py-spy). Pinned first, the copy is
    only queued (torch keeps the pinned block until the copy has run)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def micro_on_device(micro: TensorDict, device: torch.device, packed: bool) -> TensorDict:
    """A micro-batch's fields on ``device``, each copy queued without the host waiting (``queued_copy``). Packed rows
    keep their attention mask on the host, not copied: ``packed_reply_states`` lays them out there, where a mask on
    the GPU made the host wait for every queued kernel before each micro-batch (its count of real tokens)."""
    if device.type == "cpu":
        return micro
    on_device = (micro.exclude("attention_mask") if packed else micro).apply(lambda tensor: queued_copy(tensor, device))
    if packed:
        on_device["attention_mask"] = micro["attention_mask"]
    return on_device


def packed_reply_states(model, input_ids, attention_mask, width_r: int):
    """As ``dense_reply_states``, with the rows' real tokens laid end to end in one row: the decoder reads no pads
    (each row attends within itself, ``grpo.training.attention.packed_attention``) and the flat values are the
    real reply tokens' only. With real replies (0.5B on GSM8K: mean ~300 of a 512 cap) a third of a dense
    micro-batch's tokens were pads.

    The layout (which tokens are real, where each reply token sits) is worked out where ``attention_mask`` is and
    reaches ``input_ids``' device as indices: a mask on the CPU (scoring) makes the pass one the CPU queues
    without waiting for the GPU; one on the GPU (training) waits for its count of real tokens, as boolean
    indexing does."""
    device = input_ids.device
    real = attention_mask.bool()
    lengths = real.sum(-1)
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).int()
    position = real.long().cumsum(-1) - 1  # each real token's position in its row
    reply = real[:, real.shape[1] - width_r:]
    # reply token j of row i is predicted at the packed position before it: the row's start + its position - 1
    before = (cu_seqlens[:-1, None].long() + position[:, position.shape[1] - width_r:] - 1)[reply]
    tokens, reply_slots = real.flatten().nonzero()[:, 0], reply.flatten().nonzero()[:, 0]
    tokens, reply_slots, before, cu_seqlens, packed_position = (
        queued_copy(t, device) for t in (tokens, reply_slots, before, cu_seqlens, position.flatten()[tokens]))
    placeholder_mask = torch.ones(PACKED_PLACEHOLDER_MASK_SHAPE, dtype=torch.bool, device=device)
    hidden = model.get_decoder()(input_ids=input_ids.flatten()[tokens][None], position_ids=packed_position[None],
                                 attention_mask=placeholder_mask, use_cache=False, packed_cu_seqlens=cu_seqlens,
                                 packed_max_length=int(lengths.max())).last_hidden_state[0]
    targets = input_ids[:, input_ids.shape[1] - width_r:].flatten()[reply_slots]
    slots = reply.numel()
    return hidden[before], targets, lambda flat: flat.new_zeros(slots).index_put((reply_slots,), flat).view(reply.shape)


def head_log_probs(head, hidden, targets, temperature: float, with_entropy: bool, entropy_grad: bool):
    """Log-probs of ``targets`` (and the entropy) from one chunk of hidden states."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = logits.logsumexp(-1)
    token_lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # no [.., V] log-prob tensor
    if not with_entropy:
        return token_lp, None
    with torch.set_grad_enabled(entropy_grad):
        entropy = lse - (logits.softmax(-1) * logits).sum(-1)
    return token_lp, entropy
