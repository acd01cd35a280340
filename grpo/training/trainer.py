"""The trained policy, its optimiser and the GRPO step that updates them, with the counters a checkpoint
keeps and the one fact the crash policy needs: whether an update is half done."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from grpo.process.errors import UserError
from grpo.process.setup import freeze_long_lived_objects
from grpo.process.world import World, is_sharded
from grpo.training import checkpoint as ckpt
from grpo.training.logprobs import ReplyLogProbs
from grpo.training.models import inference_state_dict, mixed_precision_dtype
from grpo.training.settings import OptimizerSettings
from grpo.training.step import GRPOSettings, GRPOStep


@dataclass(frozen=True)
class TrainerSettings:
    """What the trainer reads of the config, once: the GRPO step's, the optimiser's, and how the policy is sharded."""
    grpo: GRPOSettings
    optimizer: OptimizerSettings
    mixed_precision: bool           # bf16 autocast for float32 weights on a GPU (the policy's every pass)
    reshard_after_forward: bool     # FSDP2: free gathered weights after forward
    gather_dtype: str | None        # FSDP2 with mixed precision: weights gathered in this dtype; None: their own
    score_reference_early: bool     # sync, one rank: the reference scores each batch as the engine samples it

    @classmethod
    def from_config(cls, cfg) -> TrainerSettings:
        train = cfg.train_model
        return cls(grpo=GRPOSettings.from_config(cfg), optimizer=OptimizerSettings.from_config(cfg),
                   mixed_precision=train.mixed_precision, reshard_after_forward=train.reshard_after_forward,
                   gather_dtype=train.gather_dtype, score_reference_early=cfg.ref_model.score_early)


class Trainer:
    """``update(rollouts, step)``: one GRPO step (grpo.training.step) on a batch of whole groups.

    ``policy_version`` counts optimiser steps: the version of the weights an engine generates with.
    ``completed_step`` / ``completed_rng``: the last GRPO step whose update finished, and the RNG states
    right after it: what an emergency checkpoint may keep. ``half_updated``: an optimiser step ran in
    a GRPO step that has not finished, so the weights are neither the old nor the new ones.
    On several ranks (``world``) the policy is sharded (FSDP2) and each rank trains on its share: every
    method that is a collective then has rank 0 name it first (``World.lead``), and the other ranks
    run it when told (``follow``).
    """

    def __init__(self, settings: TrainerSettings, policy_model, ref_model, *, pad_token_id: int,
                 world: World = World()):
        self.policy_model, self.world = policy_model, world
        grpo = settings.grpo
        # CPU: always float32; mixed_precision=false: float32 compute asked for
        gather_dtype = settings.gather_dtype if torch.cuda.is_available() and settings.mixed_precision else None
        # before the optimiser: it holds the shards
        scorer = world.shard(ReplyLogProbs(policy_model, grpo.temperature, grpo.packed_sequences,
                                           mixed_precision_dtype(settings.mixed_precision, policy_model)),
                             reshard_after_forward=settings.reshard_after_forward,
                             gather_dtype=getattr(torch, gather_dtype) if gather_dtype else None)
        self.optimizer = make_optimizer(settings.optimizer, policy_model)
        self.scheduler = make_scheduler(settings.optimizer, self.optimizer)
        self.grpo_step = GRPOStep(grpo, policy=scorer, optimizer=self.optimizer,
                                  scheduler=self.scheduler, ref_model=ref_model, pad_token_id=pad_token_id,
                                  world=world)
        self.score_reference_early = settings.score_reference_early
        self.policy_version = 0
        self.completed_step, self.completed_rng, self.half_updated = 0, None, False
        # an optimiser step marks the weights half updated until ``update`` returns (restoring takes no step)
        self.optimizer.register_step_pre_hook(lambda *_: setattr(self, "half_updated", True))

    def take_samples_from(self, engine) -> None:
        """``ref_model.score_early``: the reference scores each batch ``engine`` samples as it leaves the GPU
        (``grpo.training.reference``). One rank only: over several, each scores its share of every step's rows."""
        if self.score_reference_early and self.world.size == 1 and self.grpo_step.ref is not None:
            engine.on_sampled = self.grpo_step.ref.score_early

    def restore(self, payload: dict, path) -> None:
        """Weights, optimiser, schedule and counters of a checkpoint, and its RNG states (last of all).
        ``path``: the checkpoint ``payload`` was read from, which the other ranks read too."""
        self.world.lead("restore", str(path))
        ckpt.restore_training_state(payload, model=self.policy_model, optimizer=self.optimizer,
                                    scheduler=self.scheduler)
        self.policy_version = payload["counters"]["policy_version"]
        self.completed_step = payload["counters"]["step"]

    def checkpoint_state(self) -> dict:
        """Weights, optimiser and schedule as a checkpoint keeps them: whole, whatever the number of ranks."""
        self.world.lead("checkpoint_state")
        return ckpt.training_state(self.policy_model, self.optimizer, self.scheduler)

    def whole_weights(self) -> dict:
        """The policy's weights under their HF names, LoRA merged (``inference_state_dict``): what an export
        writes; gathered on every rank when sharded."""
        self.world.lead("whole_weights")
        return inference_state_dict(self.policy_model)

    def engine_weights(self):
        """What a weight push sends: the policy itself (an engine beside it on its device and dtype shares it),
        or, sharded over ranks, its whole weights, gathered on every rank: a rank with an engine of its own
        (``follow``'s ``generation``) takes them into it too."""
        if not is_sharded(self.policy_model):
            return self.policy_model
        self.world.lead("engine_weights")
        return inference_state_dict(self.policy_model)

    def update(self, rollouts, step: int) -> dict:
        # the other ranks step on rank 0's rollouts (grpo.training.replies.Replies): a few flat arrays, ~1 MB per
        # 128 replies x 512 tokens, pickled as raw buffers
        self.world.lead("update", rollouts, step)
        metrics = self.grpo_step(rollouts)  # dense batch, reference and KL, advantages, clipped loss, optimiser
        self.policy_version += metrics["optim_steps"]
        self.completed_step, self.completed_rng, self.half_updated = step, ckpt.rng_state(), False
        return metrics | {"policy_version": self.policy_version}

    def follow(self, generation=None) -> int:
        """A rank other than 0: run each collective rank 0 leads until it leads the end of the run, and return
        the exit status it ends with. ``generation``: this rank's share of generating
        (``grpo.rollout.local_rollouts.RankGeneration``): its commands, and the engine each weight gather fills. A user error raised in a command (a NaN reward, a NaN gradient norm) is
        raised on rank 0 too, from the same rollouts and global norm: rank 0 reports it and leads what follows
        (an emergency checkpoint, the end). Any other error ends this rank, which closes its connections: rank
        0's next collective then fails at once instead of waiting for gloo's timeout."""
        commands = {"update": self.update, "checkpoint_state": self.checkpoint_state,
                    "whole_weights": self.whole_weights, "engine_weights": self.engine_weights,
                    "restore": lambda path: self.restore(ckpt.load_checkpoint(path), path)}
        if generation is not None:
            commands |= generation.commands
            commands["engine_weights"] = lambda: generation.take_weights(self.engine_weights(), self.policy_version)
        while True:
            command, args = self.world.next_command()
            if command == "stop":
                return args[0]
            with contextlib.suppress(UserError):
                commands[command](*args)
            if command == "update":  # after its first step, as rank 0 (grpo.loop.run.steps)
                freeze_long_lived_objects()

    def weights_finite(self) -> bool:
        return all(p.isfinite().all() for group in self.optimizer.param_groups for p in group["params"])

    def trainable_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.policy_model.parameters() if p.requires_grad)


def make_optimizer(settings: OptimizerSettings, model) -> torch.optim.Optimizer:
    """AdamW, fused: one pass over every weight, against torch's default (foreach) 16.7 against 41.8 ms a step at
    the 1.5B shape on an H100, and 0.42 against 3.74 s at the 0.5B shape on one CPU thread
    (``benchmarks/bench_optimizer.py``)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay, betas=tuple(settings.betas),
                             eps=settings.eps, fused=True)


def make_scheduler(settings: OptimizerSettings, optimizer):
    """Linear warm-up then constant or cosine decay to ``min_lr_ratio`` of the peak at ``total_optim_steps``."""
    warmup, floor = settings.warmup_steps, settings.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if settings.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, settings.total_optim_steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
