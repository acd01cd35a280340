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
from torchrl.data import ReplayBuffer, SamplerWithoutReplacement, TensorStorage

from grpo.models import reply_log_probs, token_log_probs
from grpo.rollouts import trim_padding


class GRPOObjective:
    """The clipped GRPO loss on the dense batches of ``grpo.rollouts``.

    Same estimators as TorchRL's ``GRPOLoss`` (tests/test_trainer.py checks value and gradient
    against it): PPO-style clipped ratio with asymmetric bounds, token_mean or prompt_mean
    aggregation, masked entropy, k3 KL to the reference and to the sampler. Why not GRPOLoss
    itself: it runs on per-sample tensordicts (three copies per call, then un-padding) and
    computes full-vocabulary logits at every prompt position; on the tiny task that made our
    training step twice TRL's, and on a 0.5B model it used 2.4x TRL's GPU memory. Here one
    forward gives logits for the reply positions only. Unlike TorchRL 0.14.1, the KL terms,
    ``kl_approx`` and the clip fraction are averaged over reply tokens only, so they do not
    shrink as prompts grow.
    """

    def __init__(self, cfg, model):
        t = cfg.train
        self.model = model
        self.log_clip = (math.log1p(-t.clip_epsilon_low), math.log1p(t.clip_epsilon_high))
        self.kl_to_ref_coeff = t.kl_to_ref_coeff if (t.use_kl_to_ref and t.kl_coef_in_loss) else None
        # 0.0 still measures the trainer-vs-sampler mismatch without adding it to the loss
        self.kl_to_inference_coeff = t.kl_to_inference_coeff
        self.entropy_coeff = t.entropy_coeff
        self.aggregation = t.aggregation
        self.is_cap = t.inference_is_cap
        # Eager forward + backward of a small model is bound by the CPU launching ~2000 kernels per
        # micro-batch, not by the GPU. Compiled, the same maths runs as a few fused kernels.
        # dynamic=True: micro-batches are trimmed to their own widths, so one graph serves them all.
        self.forward = torch.compile(token_log_probs, dynamic=True) if cfg.train_model.compile else token_log_probs

    def _aggregate(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        per_token = per_token * mask
        if self.aggregation == "prompt_mean":
            return (per_token.sum(-1) / mask.sum(-1).clamp_min(1)).mean()
        return per_token.sum() / mask.sum().clamp_min(1)

    def __call__(self, batch) -> dict:
        cur, entropy = reply_log_probs(self.model, batch, with_entropy=True, entropy_grad=self.entropy_coeff != 0,
                                       forward=self.forward)
        sampler = batch["behaviour_log_probs"]
        mask = batch["reply_mask"] & sampler.isfinite()
        n_tokens = mask.sum().clamp_min(1)
        # The PPO ratio is taken against the sampler's log-probs, or, with truncated IS, against the
        # trainer's own at the start of the step; each token is then weighted by
        # min(pi_trainer_old / pi_sampler, cap), which corrects engine mismatch and staleness.
        old, is_weight = sampler, None
        if self.is_cap is not None and "trainer_log_probs" in batch.keys():
            old = batch["trainer_log_probs"]
            is_weight = torch.where(mask, old - sampler, 0.0).exp().clamp(max=self.is_cap)
        log_weight = torch.where(mask, cur - old, 0.0)
        advantage = batch["advantage"].to(cur.dtype).unsqueeze(-1)
        clipped_log_weight = log_weight.clamp(*self.log_clip)
        gain = torch.minimum(log_weight.exp() * advantage, clipped_log_weight.exp() * advantage)
        if is_weight is not None:
            gain = gain * is_weight
        out = {
            "loss_objective": self._aggregate(-gain, mask),
            "loss_entropy": -self._aggregate(entropy, mask),
        }
        # masked sums rather than boolean indexing, which would synchronise with the GPU
        with torch.no_grad():
            lw = torch.where(mask, log_weight, -torch.inf).flatten()
            out["clip_fraction"] = ((clipped_log_weight != log_weight) & mask).sum() / n_tokens
            out["ESS"] = (2 * lw.logsumexp(0) - (2 * lw).logsumexp(0)).exp() / n_tokens
            out["kl_approx"] = -log_weight.sum() / n_tokens
            if is_weight is not None:
                out["is_weight"] = (is_weight * mask).sum() / n_tokens
                out["is_truncated_fraction"] = ((is_weight >= self.is_cap) & mask).sum() / n_tokens
        for name, coeff, other in (("kl_to_ref", self.kl_to_ref_coeff, "ref_log_probs"),
                                   ("kl_to_inference", self.kl_to_inference_coeff, "behaviour_log_probs")):
            if coeff is None or other not in batch.keys():
                continue
            diff = torch.where(mask, batch[other] - cur, 0.0)
            kl = (diff.expm1() - diff).sum() / n_tokens
            out[f"loss_{name}"], out[name] = coeff * kl, kl.detach()
        return out


def total_loss(out: dict, cfg) -> torch.Tensor:
    loss = out["loss_objective"] + cfg.train.entropy_coeff * out["loss_entropy"]
    for name in ("loss_kl_to_ref", "loss_kl_to_inference"):
        if name in out:
            loss = loss + out[name]
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


def micro_batch_size(cfg) -> int:
    """Samples per forward/backward: one optimiser step's minibatch split over its accumulation steps."""
    return cfg.train.optim_batch_size // cfg.train.gradient_accumulation_steps


def make_replay_buffer(cfg, samples) -> ReplayBuffer:
    """Over one dense batch (advantages already set), used in place: shuffled micro-batches, each sample once per pass."""
    return ReplayBuffer(
        storage=TensorStorage(samples),
        sampler=SamplerWithoutReplacement(),
        batch_size=micro_batch_size(cfg),
    )


def autocast_context(cfg, device: torch.device, model):
    """bf16 autocast for float32 weights on a GPU. Weights already in bf16 gain nothing from it but
    a dispatch per op: about 10% of the training time of a 0.5B model, measured on an H200."""
    weights_fp32 = next(model.parameters()).dtype == torch.float32
    if device.type == "cuda" and cfg.train_model.mixed_precision and weights_fp32:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


LOGGED_LOSS_FIELDS = {
    "loss_objective": "loss_objective", "clip_fraction": "clip_fraction", "ESS": "ess",
    "kl_approx": "kl_approx", "kl_to_inference": "kl_to_inference", "loss_kl_to_ref": "loss_kl_to_ref",
    "is_weight": "is_weight_mean", "is_truncated_fraction": "is_truncated_fraction",
}


@contextlib.contextmanager
def train_mode_if(model, enabled: bool):
    """Train mode for the duration, when gradient checkpointing needs it (HF checkpoints only in
    train mode); the model is otherwise kept in eval mode, where ``generate`` keeps its KV cache."""
    model.train(enabled)
    try:
        yield
    finally:
        model.eval()


def optimize_on_batch(buffer, loss_fn, optimizer, scheduler, scaler, cfg, device, model) -> dict:
    """``train.epochs`` passes over the buffer; returns metrics averaged over optimiser steps.

    ``kl_to_inference_pre_update`` is the first micro-batch's sampler/trainer KL, taken before this
    batch's first optimiser step: on-policy it must be ~0 (< 1e-3), or sampler and trainer disagree
    on the tokens (masks, padding, dtype), whatever the later minibatches show.
    """
    with train_mode_if(model, cfg.train_model.gradient_checkpointing):
        return _optimize(buffer, loss_fn, optimizer, scheduler, scaler, cfg, device, model)


def _optimize(buffer, loss_fn, optimizer, scheduler, scaler, cfg, device, model) -> dict:
    accum = cfg.train.gradient_accumulation_steps
    sums, n_micro, n_steps, grad_norms = defaultdict(lambda: 0.0), 0, 0, []
    pre_update_kl = None
    for _ in range(cfg.train.epochs):
        for i, micro in enumerate(buffer):
            micro = trim_padding(micro)
            if device.type != "cpu":
                micro = micro.to(device, non_blocking=True)
            with autocast_context(cfg, device, model):
                out = loss_fn(micro)
                loss = total_loss(out, cfg) / accum
            scaler.scale(loss).backward()
            # kept as device tensors until the end: a .item() per micro-batch would stall the GPU queue
            for src, dst in LOGGED_LOSS_FIELDS.items():
                if src in out:
                    sums[dst] = sums[dst] + out[src].detach()
            sums["entropy"] = sums["entropy"] + (-out["loss_entropy"].detach())
            sums["advantage_abs"] = sums["advantage_abs"] + micro["advantage"].abs().mean()
            if n_micro == 0 and "kl_to_inference" in out:
                pre_update_kl = out["kl_to_inference"]
            n_micro += 1
            if (i + 1) % accum == 0:
                scaler.unscale_(optimizer)
                norm = torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.requires_grad], cfg.optimizer.clip_grad_norm
                )
                grad_norms.append(norm.detach())
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                n_steps += 1
    metrics = {k: float(v) / max(1, n_micro) for k, v in sums.items()}
    if pre_update_kl is not None:
        metrics["kl_to_inference_pre_update"] = float(pre_update_kl)
    metrics["grad_norm"] = float(sum(grad_norms)) / max(1, len(grad_norms))
    metrics["optim_steps"] = n_steps
    metrics["lr"] = scheduler.get_last_lr()[0]
    return metrics
