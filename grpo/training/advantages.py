"""What a reply's reward becomes before the loss: DAPO's soft overlong penalty, then its advantage
over the other replies to the same prompt (its group)."""

from __future__ import annotations

import torch


def overlong_penalty(reply_length: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max_new_tokens - buffer`` tokens, then rising
    linearly to ``penalty`` at ``max_new_tokens``."""
    over = (reply_length.float() - (max_new_tokens - buffer)).clamp(0, buffer)
    return penalty * over / buffer


def group_advantages(reward: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True) -> torch.Tensor:
    """(r - group mean) / group std (unbiased, floored at 1e-6): MCAdvantage's formula, vectorised.
    Without ``scale_by_std`` (Dr. GRPO), r - group mean: groups that barely differ are not inflated.

    Replies to the same prompt form a group, whatever their order in the batch. A lone reply
    has no baseline and gets advantage 0 (MCAdvantage would give NaN).
    """
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1
    # in float64: rewards of 3e38, finite in float32, overflowed its group sums and squares to NaN advantages
    r = reward.double()
    count = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, group, torch.ones_like(r))
    mean = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, group, r) / count
    sq = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, group, (r - mean[group]) ** 2)
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    advantage = r - mean[group] if not scale_by_std else (r - mean[group]) / std[group].clamp_min(1e-6)
    return advantage.to(reward.dtype)
