"""Turning collected rollouts into training samples.

The collector returns, per sample, the tokens and the log-probs the generating policy gave
its reply. Here we (1) keep those as the behaviour log-probs the importance ratio needs
(never recomputed with the current weights: that would make every ratio 1), (2) score the
reference model on the same tokens and (3) optionally move the KL-to-reference into the reward.
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase


def set_behaviour_log_probs(data: TensorDictBase) -> None:
    """``("log_probs","full")`` over prompt+reply, the layout GRPOLoss reads; prompt positions are 0 and masked out."""
    # Replies differ in length: write each sample of the lazy stack on its own.
    for sample in data.unbind(0):
        prompt_len = sample["tokens", "prompt"].shape[-1]
        response = sample["log_probs", "response"]
        sample.set(("log_probs", "full"), torch.cat([response.new_zeros(prompt_len), response]))


@torch.no_grad()
def set_reference_log_probs(data: TensorDictBase, ref_wrapper, device: torch.device) -> None:
    """``("ref_log_probs","full")``: the reference model's log-probs of the same token sequences."""
    # the sampler's attention masks, not ones rebuilt from pad ids (a reply may contain the pad token)
    scored = ref_wrapper(data.select(("tokens", "full"), ("masks", "all_attention_mask"), strict=False).to(device))
    for sample, scored_sample in zip(data.unbind(0), scored.unbind(0)):
        sample.set(("ref_log_probs", "full"), scored_sample["ref_log_probs", "full"].float().to(data.device or "cpu"))


def per_sample_kl_to_ref(data: TensorDictBase) -> torch.Tensor:
    """Per sample, the mean over reply tokens of the k3 estimate of KL(behaviour || reference)."""
    kls = []
    for sample in data.unbind(0):
        n = sample["tokens", "response"].shape[-1]
        if n == 0:
            kls.append(torch.zeros(()))
            continue
        diff = sample["ref_log_probs", "full"][-n:] - sample["log_probs", "full"][-n:]
        kls.append((diff.expm1() - diff).mean())
    return torch.stack(kls)


def apply_kl_reward_penalty(data: TensorDictBase, coeff: float) -> None:
    """reward <- reward - coeff * KL(behaviour || reference), before group advantages are computed."""
    reward = data.get(("next", "reward"))
    penalty = per_sample_kl_to_ref(data).to(reward.dtype).view(-1, *([1] * (reward.ndim - 1)))
    data.set(("next", "reward"), reward - coeff * penalty)


def prepare_rollouts(data: TensorDictBase, *, ref_wrapper, ref_device, kl_to_ref_coeff: float,
                     kl_in_reward: bool) -> dict:
    """Mutates ``data`` in place into training samples; returns rollout statistics for logging."""
    set_behaviour_log_probs(data)
    stats = {
        "reward": data.get(("next", "reward")).float().mean().item(),
        "success_rate": data.get(("next", "success")).float().mean().item(),
        "response_length": float(sum(s["tokens", "response"].shape[-1] for s in data.unbind(0)) / data.numel()),
    }
    if ref_wrapper is not None:
        set_reference_log_probs(data, ref_wrapper, ref_device)
        stats["kl_to_ref"] = per_sample_kl_to_ref(data).mean().item()
        if kl_in_reward:
            apply_kl_reward_penalty(data, kl_to_ref_coeff)
    return stats
