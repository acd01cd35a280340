"""Sync rollouts: TorchRL's collector over the training env, generating with this process's engine.

A rollout source (this one, and the Ray pool of ``ray_collectors.RolloutPool``) is what the loop of
``grpo.loop.run`` draws from:

    next_rollouts(trainer_version)  one collection of whole groups, as ``grpo.rollout.replies.Replies``
    commit()                        the step that took them finished: their prompts count as trained
    after_update(weights, version)  hand the engines the new weights (Trainer.engine_weights) when due; returns
                                    the push's metrics
    step_metrics()                  how generation went since the last call
    state()                         what a checkpoint keeps of it (the prompt stream)
    shutdown()
"""

from __future__ import annotations

import time

from grpo.rollout.replies import Replies
from grpo.tasks.data import PromptLedger, serve_from
from grpo.tasks.user_rewards import take_reward_seconds


class CollectorRollouts:
    """The collector draws prompt batch after batch from where ``ledger`` says; weights reach the
    engine after every GRPO step."""

    def __init__(self, cfg, env, collector, ledger: PromptLedger, engine):
        self.env, self.collector, self.ledger, self.engine = env, collector, ledger, engine
        serve_from(env, collector, ledger.sequential_start())  # the collector then draws batch after batch
        self.batches = iter(collector)
        self.batches_per_step = cfg.train.dialog_turns_per_batch // cfg.env.num_envs
        self.taken: list[int] = []  # the prompt batches this step's collections drew
        self.generation_s = 0.0

    def next_rollouts(self, trainer_version: int) -> Replies:
        """One collection: G replies for each prompt, with sampler log-probs."""
        t0 = time.perf_counter()
        self.taken.extend(self.ledger.take() for _ in range(self.batches_per_step))  # the batches it draws next
        rollouts = Replies.from_collector(next(self.batches))
        self.generation_s += time.perf_counter() - t0
        return rollouts

    def commit(self) -> None:
        self.ledger.consume(self.taken)
        self.taken.clear()

    def after_update(self, weights, version: int) -> dict:
        return {"weight_sync_s": self.engine.push_weights(weights, version)}

    def step_metrics(self) -> dict:
        generation_s, self.generation_s = self.generation_s, 0.0
        return {"generation_s": generation_s, "reward_s": take_reward_seconds(self.env)}  # reward_s: part of generation_s

    def state(self) -> dict:
        return {"prompt_stream": self.ledger.state()}

    def shutdown(self) -> None:
        self.collector.shutdown()
