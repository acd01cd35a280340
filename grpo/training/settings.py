"""What model loading and the optimiser read of the config, in one place (``ModelSettings.from_config``,
``OptimizerSettings.from_config``); the GRPO step's is ``grpo.training.step.GRPOSettings``, the trainer's
``grpo.training.trainer.TrainerSettings``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSettings:
    """The policy's and the reference's weights, read from the config once: ``load_policy_model`` and
    ``load_reference_model`` take these, never the config itself. Values are kept as composed."""
    name: str                       # model.name: hub name or local folder; the reference starts from it too
    policy_dtype: str               # train_model.dtype: the trained weights' on a GPU (CPU: float32)
    reference_dtype: str            # ref_model.dtype: the reference's on a GPU (CPU: float32)
    reference: bool                 # train.use_kl_to_ref: a frozen reference is loaded beside the policy
    lora: bool                      # train LoRA adapters instead of all weights
    lora_r: int                     # adapter rank
    lora_alpha: int                 # adapter scaling numerator (scale = alpha / r)
    lora_dropout: float             # dropout on the adapter input
    lora_target_modules: Sequence[str]  # layers that get adapters
    gradient_checkpointing: bool    # recompute activations in backward
    checkpoint_fraction: float      # share of decoder layers (the first) that recompute

    @classmethod
    def from_config(cls, cfg) -> ModelSettings:
        train, lora = cfg.train_model, cfg.train_model.lora
        return cls(name=cfg.model.name, policy_dtype=train.dtype, reference_dtype=cfg.ref_model.dtype,
                   reference=cfg.train.use_kl_to_ref, lora=lora.enabled, lora_r=lora.r, lora_alpha=lora.alpha,
                   lora_dropout=lora.dropout,
                   lora_target_modules=lora.target_modules, gradient_checkpointing=train.gradient_checkpointing,
                   # a checkpoint's config from before the key (2026-11-26) still exports: all layers recomputed then
                   checkpoint_fraction=train.get("checkpoint_fraction", 1.0))


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW and its learning-rate schedule, read from the config once: ``make_optimizer`` and ``make_scheduler``
    take these. The gradient clip is the step's (``GRPOSettings.clip_grad_norm``)."""
    lr: float                       # peak learning rate
    weight_decay: float             # decoupled weight decay
    betas: Sequence[float]
    eps: float
    warmup_steps: int               # optimiser steps of linear warm-up
    schedule: str                   # after warm-up: constant or cosine
    min_lr_ratio: float             # cosine floor as a fraction of lr
    total_optim_steps: int          # the cosine's length: the optimiser steps of train.total_steps GRPO steps

    @classmethod
    def from_config(cls, cfg) -> OptimizerSettings:
        o, t = cfg.optimizer, cfg.train
        return cls(lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, eps=o.eps, warmup_steps=o.warmup_steps,
                   schedule=o.schedule, min_lr_ratio=o.min_lr_ratio,
                   total_optim_steps=t.total_steps * t.epochs * t.dialog_turns_per_batch // t.optim_batch_size)
