"""The GRPO optimisation step, shared by the sync and async scripts.

``optimize_on_batch`` runs ``train.epochs`` passes over one batch of grouped rollouts held in
a replay buffer, in minibatches of ``train.optim_batch_size`` samples split into
``train.gradient_accumulation_steps`` micro-batches.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict

import torch
from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement
from torchrl.objectives.llm import GRPOLoss, MCAdvantage


class MaskedGRPOLoss(GRPOLoss):
    """TorchRL's GRPOLoss with its diagnostics and KL terms averaged over reply tokens only.

    TorchRL 0.14.1 averages the k3 KL estimate and the clip fraction over every padded
    position, prompt included, so the effective KL coefficient and the reported clip
    fraction shrink as prompts grow. Same estimators here, masked to the reply tokens.
    """

    def _log_weight(self, tensordict, adv_shape):
        log_weight, dist, kl_approx, mask = super()._log_weight(tensordict, adv_shape)
        self._reply_mask = mask
        return log_weight, dist, kl_approx, mask

    def _compute_policy_objective(self, log_weight, advantage):
        loss, _ = super()._compute_policy_objective(log_weight, advantage)
        mask = self._reply_mask.unsqueeze(-1)
        clipped = log_weight.clamp(*self._clip_bounds) != log_weight
        return loss, (clipped & mask).sum() / mask.sum().clamp_min(1)

    def _kl_to_ref(self, tensordict, key=("next", "ref_log_probs"), ref_log_prob=None, coeff=None,
                   mask=None, dist=None):
        coeff = self.kl_to_ref_coeff if coeff is None else coeff
        cur_log_prob = tensordict.get("_cur_log_prob")
        if ref_log_prob is None:
            ref_log_prob = tensordict.get(key, as_padded_tensor=True, padding_side=self.ref_log_prob_padding_side,
                                          padding_value=self.ref_log_prob_padding_value)
            if ref_log_prob.ndim == cur_log_prob.ndim + 1:
                ref_log_prob = ref_log_prob.squeeze(-1)
        diff = (ref_log_prob.to(cur_log_prob.dtype) - cur_log_prob)[mask]
        kl = (diff.expm1() - diff).mean()
        return coeff * kl, kl


def make_loss(cfg, train_wrapper) -> GRPOLoss:
    t = cfg.train
    loss = MaskedGRPOLoss(
        train_wrapper,
        clip_epsilon=(t.clip_epsilon_low, t.clip_epsilon_high),
        kl_to_ref_coeff=t.kl_to_ref_coeff if (t.use_kl_to_ref and t.kl_coef_in_loss) else None,
        # 0.0 still measures the trainer-vs-sampler mismatch without adding it to the loss
        kl_to_inference_coeff=t.kl_to_inference_coeff,
        entropy_bonus=True,
        # The masked entropy is always computed for logging; cfg's coefficient is applied in total_loss.
        entropy_coeff=1.0,
        aggregation=t.aggregation,
        masking_strategy="sft",
    )
    loss.set_keys(sample_log_prob=("log_probs", "full"), ref_log_probs=("ref_log_probs", "full"))
    return loss


def total_loss(out, cfg) -> torch.Tensor:
    loss = out.loss_objective + cfg.train.entropy_coeff * out.loss_entropy
    for name in ("loss_kl_to_ref", "loss_kl_to_inference"):
        term = getattr(out, name, None)
        if term is not None:
            loss = loss + term
    return loss


def make_optimizer(cfg, model) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optimizer
    return torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps)


def make_scheduler(cfg, optimizer, total_optim_steps: int):
    """Linear warm-up then constant or cosine decay to ``optimizer.min_lr_ratio`` of the peak."""
    o = cfg.optimizer

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        if o.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - o.warmup_steps) / max(1, total_optim_steps - o.warmup_steps))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_replay_buffer(cfg) -> ReplayBuffer:
    """Holds one collected batch; MCAdvantage writes each group once all its ``env.repeats`` replies are in."""
    micro = cfg.train.optim_batch_size // cfg.train.gradient_accumulation_steps
    buffer = ReplayBuffer(
        storage=LazyStackStorage(cfg.train.dialog_turns_per_batch),
        sampler=SamplerWithoutReplacement(),
        batch_size=micro,
    )
    buffer.append_transform(MCAdvantage(grpo_size=cfg.env.repeats))
    return buffer


def autocast_context(cfg, device: torch.device):
    if device.type == "cuda" and cfg.train_model.mixed_precision:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# What GRPOLoss reads: copying the rest (histories, texts, env fields) of every sample of every
# micro-batch cost about a fifth of the optimisation time on the tiny model.
LOSS_INPUT_KEYS = [("tokens", "full"), ("tokens", "prompt"), ("tokens", "response"), ("masks", "all_attention_mask"),
                   ("masks", "all_assistant_mask"), ("log_probs", "full"), ("ref_log_probs", "full"), "advantage"]

LOGGED_LOSS_FIELDS = {
    "loss_objective": "loss_objective", "clip_fraction": "clip_fraction", "ESS": "ess",
    "kl_approx": "kl_approx", "kl_to_inference": "kl_to_inference", "loss_kl_to_ref": "loss_kl_to_ref",
}


def optimize_on_batch(buffer, loss_fn, optimizer, scheduler, scaler, cfg, device, model) -> dict:
    """``train.epochs`` passes over the buffer; returns metrics averaged over optimiser steps."""
    accum = cfg.train.gradient_accumulation_steps
    sums, n_micro, n_steps, grad_norms = defaultdict(float), 0, 0, []
    for _ in range(cfg.train.epochs):
        for i, micro in enumerate(buffer):
            micro = micro.select(*LOSS_INPUT_KEYS, strict=False)
            if device.type != "cpu":
                micro = micro.to(device)
            with autocast_context(cfg, device):
                out = loss_fn(micro)
                loss = total_loss(out, cfg) / accum
            scaler.scale(loss).backward()
            for src, dst in LOGGED_LOSS_FIELDS.items():
                value = getattr(out, src, None)
                if value is not None:
                    sums[dst] += float(value.detach())
            sums["entropy"] += float(-out.loss_entropy.detach())
            sums["advantage_abs"] += float(micro["advantage"].abs().mean())
            n_micro += 1
            if (i + 1) % accum == 0:
                scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.requires_grad], cfg.optimizer.clip_grad_norm
                )
                grad_norms.append(float(norm))
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                n_steps += 1
    metrics = {k: v / max(1, n_micro) for k, v in sums.items()}
    metrics["grad_norm"] = sum(grad_norms) / max(1, len(grad_norms))
    metrics["optim_steps"] = n_steps
    metrics["lr"] = scheduler.get_last_lr()[0]
    return metrics
