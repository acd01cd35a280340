"""The dense training batch: collected rollouts as padded ``[S, T]`` tensors.

The rollout sources hand over ``grpo.training.replies.Replies``: ragged token ids, one after another.
Every later stage (reference scoring, advantages, minibatch sampling, the loss) is cheaper on
padded ``[S, T]`` tensors: on the tiny task, per-sample tensordict bookkeeping was about 45% of
a step (docs/trl_comparison.md). So the batch is made dense once, here:

* ``input_ids``: prompts left-padded to ``P`` columns, replies right-padded to ``R`` columns,
  so every reply starts at column ``P`` and the model's logits are needed for the last
  ``R + 1`` positions only;
* ``attention_mask`` (every real token, the environment's turns included) and ``reply_mask`` (``[S, R]``: the
  sampled tokens, the one mask the loss, the KL terms, the entropy and the reply lengths read): built from lengths
  and the episodes' sampled marks, never from pad ids (a reply may end in the pad token), so padding and the
  environment's tokens never enter the loss or the metrics;
* ``behaviour_log_probs`` (``[S, R]``): the log-probs the *generating* policy gave each reply
  token, kept as sampled. Recomputing them with the current weights would make every
  importance ratio 1 and clipping would do nothing;
* ``ref_log_probs``, ``reward``, ``advantage`` and the lengths.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from grpo.training.replies import Replies


def to_training_batch(replies: Replies, pad_token_id: int) -> TensorDict:
    """The replies as one dense batch (see the module docstring). An episode whose tool failed for want of the
    sandbox (not the model's doing) is left out: of the loss (no sampled token) and of its group's baseline."""
    failed = replies.tool_failures > 0
    masks = [mask & (not bad) for mask, bad in zip(replies.sampled_masks(), failed.tolist())]
    batch = token_batch(replies.prompts(), replies.replies(), pad_token_id, masks)
    n, width_r = batch.batch_size[0], batch["reply_mask"].shape[1]
    behaviour_lp = torch.zeros(n, width_r)
    for i, (lp, end) in enumerate(zip(replies.log_probs(), batch["reply_length"].tolist())):
        behaviour_lp[i, :end] = lp[:end]
    batch.update({
        "behaviour_log_probs": behaviour_lp * batch["reply_mask"],
        "reward": replies.reward.clone(),
        "reply_stopped": ~replies.truncated,
        "in_baseline": ~failed,
        "group_id": group_ids(replies),
    })
    return batch


def token_batch(prompts: list[torch.Tensor], replies: list[torch.Tensor], pad_token_id: int,
                sampled_masks: list[torch.Tensor] | None = None) -> TensorDict:
    """The dense batch's token fields (``input_ids``, ``attention_mask``, ``reply_mask``: the sampled tokens of
    ``sampled_masks``, all when None, ``prompt_length``, ``reply_length``, ``sampled_length``): all that scoring
    reads, whether from the collected replies or straight from the policy's episodes (``grpo.training.reference``)."""
    prompt_len = torch.tensor([p.numel() for p in prompts], dtype=torch.long)
    reply_len = torch.tensor([r.numel() for r in replies], dtype=torch.long)
    n, width_p, width_r = len(replies), int(prompt_len.max()), int(reply_len.max()) if len(reply_len) else 0
    input_ids = torch.full((n, width_p + width_r), pad_token_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, replies)):
        input_ids[i, width_p - p.numel():width_p] = p
        input_ids[i, width_p:width_p + r.numel()] = r
    cols = torch.arange(width_p + width_r)
    attention_mask = (cols >= width_p - prompt_len[:, None]) & (cols < width_p + reply_len[:, None])
    reply_mask = attention_mask[:, width_p:].clone()
    if sampled_masks is not None:
        for i, mask in enumerate(sampled_masks):
            reply_mask[i, :mask.numel()] &= mask
    return TensorDict({"input_ids": input_ids, "attention_mask": attention_mask, "reply_mask": reply_mask,
                       "prompt_length": prompt_len, "reply_length": reply_len, "sampled_length": reply_mask.sum(1)},
                      batch_size=[n])


def trim_padding(batch: TensorDict) -> TensorDict:
    """Drop the prompt columns no sample attends to and the reply columns past the longest reply."""
    width_r = batch["reply_mask"].shape[1]
    width_p = batch["input_ids"].shape[1] - width_r
    keep_p, keep_r = int(batch["prompt_length"].max()), int(batch["reply_length"].max())
    if keep_p == width_p and keep_r == width_r:
        return batch
    seq = slice(width_p - keep_p, width_p + keep_r)
    out = batch.clone(recurse=False)
    out["input_ids"], out["attention_mask"] = batch["input_ids"][:, seq], batch["attention_mask"][:, seq]
    for key in ("reply_mask", "behaviour_log_probs", "ref_log_probs", "trainer_log_probs", "is_weight"):
        if key in batch.keys():
            out[key] = batch[key][:, :keep_r]
    return out


def group_ids(replies: Replies) -> torch.Tensor:
    """Which group each reply is in: the replies to one prompt (its token sequence) form a group, numbered
    in order of first appearance. The one definition of a group: the dense batch's ``group_id`` (the
    advantages' baselines), dynamic sampling and the samples shown all take it from here."""
    ids: dict[tuple, int] = {}
    return torch.tensor([ids.setdefault(tuple(p.tolist()), len(ids)) for p in replies.prompts()], dtype=torch.long)


def micro_batches(batch: TensorDict, max_rows: int, max_tokens: int | None, packed: bool = False):
    """``(rows, trimmed micro-batch)`` pairs covering ``batch``, cut by ``micro_batch_rows``."""
    for rows in micro_batch_rows(batch, max_rows, max_tokens, packed=packed):
        yield rows, trim_padding(batch[rows])


def micro_batch_rows(batch: TensorDict, max_rows: int, max_tokens: int | None, min_rows: int = 1,
                     packed: bool = False) -> list:
    """Row indices of micro-batches covering ``batch``: rows sorted by length and cut greedily at
    ``max_rows`` rows or ``max_tokens`` tokens: padded ones (rows x trimmed width), or real ones when the rows
    are ``packed``; short replies share micro-batches and are not padded to the longest reply of a random draw.
    A cut of fewer than ``min_rows`` rows joins its neighbour (data-parallel ranks each need a row of every
    micro-batch)."""
    lengths = batch["prompt_length"] + batch["reply_length"]
    order = lengths.argsort(stable=True).tolist()
    prompt_len, reply_len, length = batch["prompt_length"].tolist(), batch["reply_length"].tolist(), lengths.tolist()
    cuts, current, width_p, width_r, real = [], [], 0, 0, 0
    for row in order:
        wp, wr = max(width_p, prompt_len[row]), max(width_r, reply_len[row])
        tokens = real + length[row] if packed else (len(current) + 1) * (wp + wr)
        if current and (len(current) == max_rows or (max_tokens and tokens > max_tokens)):
            cuts.append(current)
            current, wp, wr, real = [], prompt_len[row], reply_len[row], 0
        current.append(row)
        width_p, width_r, real = wp, wr, real + length[row]
    cuts.append(current)
    merged = []
    for cut in cuts:
        if merged and (len(cut) < min_rows or len(merged[-1]) < min_rows):
            merged[-1] = merged[-1] + cut
        else:
            merged.append(cut)
    return [torch.tensor(rows) for rows in merged]


def rollout_metrics(replies: Replies, batch: TensorDict) -> dict:
    """What a step trained on: reward, success, reply lengths and truncation, and which data rows."""
    calls = max(int(replies.tool_calls.sum()), 1)
    metrics = {
        "reward": batch["reward"].double().mean().item(),  # double: rewards near 3.4e38 overflow a float32 sum
        "success_rate": replies.success.float().mean().item(),
        # the model's own tokens: an episode's environment turns are not its reply
        "response_length": batch["sampled_length"].float().mean().item(),
        "response_length_max": int(batch["sampled_length"].max()),
        "sampled_tokens": int(batch["sampled_length"].sum()),  # the model's tokens the step trained on
        # episodes cut short of a final answer: by max_new_tokens, env.max_turns or env.max_episode_tokens
        "response_truncated_fraction": 1 - batch["reply_stopped"].float().mean().item(),
        "episode/turns": replies.turns.float().mean().item(),
        "episode/truncated_fraction": replies.truncated.float().mean().item(),
        "tools/calls_per_episode": replies.tool_calls.float().mean().item(),
        "tools/error_rate": int(replies.tool_errors.sum()) / calls,
        "tools/timeout_rate": int(replies.tool_timeouts.sum()) / calls,
        "tools/sandbox_failures": int(replies.tool_failures.sum()),
        "prompt_indices": sorted(set(replies.row_index.tolist())),  # which data rows (resume tests compare them)
    }
    return metrics
