"""What the rollout layer reads of the config, in one place (``RolloutSettings.from_config``); the async pool's own
is ``grpo.rollout.ray_collectors.PoolSettings``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RolloutSettings:
    """How a step's replies are drawn, read from the config once: the rollout sources and the loop's draw take these,
    never the config itself."""
    replies_per_step: int           # train.dialog_turns_per_batch
    num_envs: int                   # env.num_envs: replies one env batch generates (prompts x repeats)
    repeats: int                    # env.repeats: replies per prompt, one GRPO group
    dynamic_sampling: bool          # groups whose rewards are all alike dropped, more batches drawn
    max_extra_batches: int          # train.max_extra_generation_batches: those more batches a step, at most

    @classmethod
    def from_config(cls, cfg) -> RolloutSettings:
        train = cfg.train
        return cls(replies_per_step=train.dialog_turns_per_batch, num_envs=cfg.env.num_envs, repeats=cfg.env.repeats,
                   dynamic_sampling=train.dynamic_sampling, max_extra_batches=train.max_extra_generation_batches)
