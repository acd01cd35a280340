"""Importance weights for off-policy replies (``train.importance_sampling``), and what they say about the mismatch.

The sampler's log-probs are not the trainer's: another engine or precision, and (async) weights up to
``train.max_policy_lag`` versions old. With a mode on, the step scores the replies with the trainer before it
updates, takes the PPO ratio against those log-probs, and weighs each token's term by the importance weight
w = pi_trainer / pi_sampler, bounded:

    token_truncate      per token, min(w_t, is_high)
    token_mask          per token, w_t if is_low <= w_t <= is_high, else 0 (the token leaves the gradient)
    sequence_truncate   per reply, W = prod_t w_t (its likelihood ratio), min(W, is_high) on each of its tokens
    sequence_mask       per reply, W if is_low <= W <= is_high, else 0 (the whole reply leaves the gradient)

Truncation caps from above only: raising a low weight would add bias and no variance is saved. A masked token
still counts in the loss's denominators, so the loss's scale does not move with how many are masked.
"""

from __future__ import annotations

import math

import torch


def importance_weights(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, mode: str, low: float,
                       high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, R]`` weights of ``mode`` (not ``none``) over the tokens of ``mask``, and where the bounds changed them
    (capped or masked). In log space: a reply's product of ratios overflows float32 past a log-ratio of 88."""
    log_w = torch.where(mask, trainer - sampler, 0.0)
    if mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    log_high = math.log(high)
    if mode.endswith("truncate"):
        out = log_w > log_high
        weight = log_w.clamp(max=log_high).exp()
    else:
        out = (log_w > log_high) | (log_w < (math.log(low) if low > 0 else -math.inf))
        weight = torch.where(out, 0.0, log_w.exp())
    return weight * mask, out & mask


def add_importance_weights(batch, mask: torch.Tensor, mode: str, low: float, high: float) -> dict:
    """``batch["is_weight"]``, what the loss weighs ``mask``'s tokens by (with ``mode`` on; it reads the trainer's
    log-probs, ``trainer_log_probs``), and the step's weight metrics: the weights' mean over the loss's tokens (1
    with ``none``), the share of tokens whose weight the bounds changed (capped or masked), and in the sequence
    modes the share of replies."""
    weight, changed = mask.float(), torch.zeros_like(mask)
    if mode != "none":
        weight, changed = importance_weights(batch["trainer_log_probs"], batch["behaviour_log_probs"], mask, mode,
                                             low, high)
        batch["is_weight"] = weight
    tokens = mask.sum().clamp_min(1)
    out = {"mismatch/is_weight_mean": float((weight * mask).sum() / tokens),
           "mismatch/masked_token_fraction": float(changed.sum() / tokens)}
    if mode.startswith("sequence"):
        replies = mask.any(-1)
        out["mismatch/masked_reply_fraction"] = float(changed.any(-1).sum() / replies.sum().clamp_min(1))
    return out
