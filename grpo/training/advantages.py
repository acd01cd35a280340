"""What a reply's reward becomes before the loss: DAPO's soft overlong penalty, then its advantage
over the other replies to the same prompt (its group)."""

from __future__ import annotations

import torch


def overlong_penalty(reply_length: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to ``max_new_tokens - buffer`` tokens, then rising
    linearly to ``penalty`` at ``max_new_tokens``."""
    over = (reply_length.float() - (max_new_tokens - buffer)).clamp(0, buffer)
    return penalty * over / buffer


def group_advantages(reward: torch.Tensor, group_ids: torch.Tensor, scale_by_std: bool = True,
                     in_baseline: torch.Tensor | None = None) -> torch.Tensor:
    """(r - group mean) / group std (unbiased, floored at 1e-6): MCAdvantage's formula, vectorised.
    Without ``scale_by_std`` (Dr. GRPO), r - group mean: groups that barely differ are not inflated.

    Replies to the same prompt form a group, whatever their order in the batch. A lone reply
    has no baseline and gets advantage 0 (MCAdvantage would give NaN). ``in_baseline`` (None: all): the replies
    the group's statistics count; the others (a tool that failed for want of the sandbox) get advantage 0.
    """
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1
    # in float64: rewards of 3e38, finite in float32, overflowed its group sums and squares to NaN advantages
    counted = torch.ones_like(reward, dtype=torch.float64) if in_baseline is None else in_baseline.double()
    r = reward.double() * counted
    count = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, group, counted)
    mean = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, group, r) / count.clamp_min(1)
    sq = torch.zeros(n_groups, dtype=r.dtype).index_add_(0, group, counted * (r - mean[group]) ** 2)
    std = (sq / (count - 1).clamp_min(1)).sqrt()
    advantage = r - mean[group] if not scale_by_std else (r - mean[group]) / std[group].clamp_min(1e-6)
    return (advantage * counted).to(reward.dtype)
