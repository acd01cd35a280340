"""Sync rollouts: TorchRL's collector over the training env, generating with this process's engine; over several
trainer ranks that each have an engine, every rank generates its share of each prompt batch.

A rollout source (this one, and the Ray pool of ``ray_collectors.RolloutPool``) is what the loop of
``grpo.loop.run`` draws from:

    next_rollouts(trainer_version)  one collection of whole groups, as ``grpo.training.replies.Replies``
    commit()                        the step that took them finished: their prompts count as trained
    after_update(weights, version)  hand the engines the new weights when due, asking ``weights()``
                                    (Trainer.engine_weights: on several ranks a gather) only then; returns
                                    the push's metrics
    step_metrics()                  how generation went since the last call
    state()                         what a checkpoint keeps of it (the prompt stream)
    shutdown()
"""

from __future__ import annotations

import contextlib
import pickle
import time
from collections.abc import Callable

import torch

from grpo.inference.engine import make_inference
from grpo.inference.generation import EngineSettings
from grpo.process.errors import UserError
from grpo.process.world import World
from grpo.rollout.dynamic_sampling import env_batches_per_draw
from grpo.rollout.settings import RolloutSettings
from grpo.tasks.data import PromptLedger, data_primer, serve_from
from grpo.tasks.envs import make_collector, make_env
from grpo.tasks.settings import TaskSettings
from grpo.tasks.tool_env import make_turn_env, turn_stop_ids
from grpo.tasks.user_rewards import take_reward_seconds
from grpo.training.replies import Replies


class CollectorRollouts:
    """The collector draws prompt batch after batch from where ``ledger`` says; weights reach the
    engine after every GRPO step. Over ``world``'s ranks (each with an engine, ``rank_rollouts``), rank 0 leads
    each collection, every rank generates its share of the prompt batches, and rank 0 gathers the shares in rank
    order: the whole batch, each prompt's group whole, which rank 0 then trains on as it would on its own."""

    def __init__(self, rollout: RolloutSettings, env, collector, ledger: PromptLedger, engine,
                 world: World = World()):
        self.env, self.collector, self.ledger, self.engine, self.world = env, collector, ledger, engine, world
        start = ledger.sequential_start()
        world.lead("rollouts", start)  # the other ranks build theirs, from the batch rank 0's ledger says
        serve_from(env, collector, start)  # the collector then draws batch after batch
        self.batches = iter(collector)
        self.batches_per_step = env_batches_per_draw(rollout)
        self.taken: list[int] = []  # the prompt batches this step's collections drew
        self.generation_s = self.slowest_rank_s = self.engine_s = self.env_s = 0.0
        self.engines_mismatched = 0

    def next_rollouts(self, trainer_version: int, seed: int | None = None) -> Replies | None:
        """One collection: G replies for each prompt, with sampler log-probs (the other ranks: None, their share
        sent to rank 0, sampled from ``seed``, which rank 0 drew and leads the collection with)."""
        if self.world.size > 1:  # every rank's sampling follows rank 0's RNG, which checkpoints keep: resume is exact
            if self.world.is_main:
                seed = int(torch.randint(2**62, ()))
                self.world.lead("generate", trainer_version, seed)
            torch.manual_seed(seed + self.world.rank)
        t0, engine_s, env_s = time.perf_counter(), self.engine.generate_s, self.engine.policy.env_seconds
        self.taken.extend(self.ledger.take() for _ in range(self.batches_per_step))  # the batches it draws next
        own, failure = None, None
        try:
            own = Replies.from_collector(next(self.batches))
        except Exception as err:  # noqa: BLE001 - every rank must reach the gather: rank 0 raises it after
            if self.world.size == 1:
                raise
            failure = err
        own_s = time.perf_counter() - t0
        self.engine_s += self.engine.generate_s - engine_s
        self.env_s += self.engine.policy.env_seconds - env_s
        # each engine's weights, read back: every push must have reached every rank's engine
        checksum = self.engine.weights_checksum() if self.world.size > 1 else None
        shares = self.world.gather_to_main((own, own_s, checksum, sendable(failure)))
        self.generation_s += time.perf_counter() - t0
        if shares is None:
            return None  # a failure here is rank 0's to raise; this rank goes on following it
        if failure is not None:
            raise failure
        for rank, (_, _, _, err) in enumerate(shares):
            if err is not None:  # a user error (a NaN reward) keeps its type and one-line message
                raise err if isinstance(err, UserError) else RuntimeError(f"rank {rank} failed generating ({err})")
        self.slowest_rank_s += max(seconds for _, seconds, _, _ in shares)
        self.engines_mismatched += sum(rank_checksum != checksum for _, _, rank_checksum, _ in shares)
        return Replies.cat([replies for replies, _, _, _ in shares])

    def commit(self) -> None:
        self.ledger.consume(self.taken)
        self.taken.clear()

    def after_update(self, weights: Callable[[], object], version: int) -> dict:
        return {"weight_sync_s": self.engine.push_weights(weights(), version)}

    def step_metrics(self) -> dict:
        # rank 0's parts of generation_s: in the engine's generate calls, and in the reward functions
        # generation_env_s: waiting on the turn environment (a tool's calls), the engine idle meanwhile
        metrics = {"generation_s": self.generation_s, "generation_engine_s": self.engine_s,
                   "generation_env_s": self.env_s, "reward_s": take_reward_seconds(self.env)}
        self.generation_s = self.engine_s = self.env_s = 0.0
        if self.world.size > 1:  # the slowest rank's own generation; engines that missed a push (must stay 0)
            metrics |= {"generation_s_slowest_rank": self.slowest_rank_s,
                        "engine_weights_mismatched": self.engines_mismatched}
            self.slowest_rank_s = 0.0
        return metrics

    def state(self) -> dict:
        return {"prompt_stream": self.ledger.state()}

    def shutdown(self) -> None:
        self.collector.shutdown()


def sendable(err: Exception | None):
    """A rank's error as it travels to rank 0: a user error itself (its one line is the run's report) where it
    pickles, any other as its type and message."""
    if isinstance(err, UserError):
        with contextlib.suppress(Exception):  # whatever stops it pickling
            pickle.dumps(err)
            return err
    return None if err is None else f"{type(err).__name__}: {err}"


def rank_rollouts(rollout: RolloutSettings, task: TaskSettings, tokenizer, engine, ledger: PromptLedger,
                  world: World = World()) -> CollectorRollouts:
    """This rank's sync source over ``engine``: an env of ``1/world.size`` of ``env.num_envs``, drawing this rank's
    share of every prompt batch (prompts ``r*P/N .. (r+1)*P/N`` of batch ``b`` of ``P``; ``allocate_devices`` checked
    that they split), and a collector of its share of each step's replies."""
    env = make_env(task, tokenizer, split=task.train_split, repeats=rollout.repeats,
                   num_envs=rollout.num_envs // world.size)
    data_primer(env).dataloader.share_of(world.rank, world.size, rollout.num_envs // rollout.repeats)
    collector = make_collector(env, engine.policy, rollout.replies_per_step // world.size)
    return CollectorRollouts(rollout, env, collector, ledger, engine, world)


class RankGeneration:
    """A trainer rank other than 0 generating its share of each sync step (``Trainer.follow`` runs it): its engine,
    built from the first weights rank 0 gathers (``Trainer.engine_weights``) and given every later gather's; its
    source, built when rank 0 builds its own (``rollouts``, with the prompt batch rank 0's ledger starts at); then
    each collection rank 0 leads (``generate``)."""

    def __init__(self, engine_settings: EngineSettings, rollout: RolloutSettings, task: TaskSettings, tokenizer,
                 model_stop_ids: list[int], device, world: World):
        self.engine_settings, self.rollout, self.task = engine_settings, rollout, task
        self.tokenizer, self.device, self.world = tokenizer, device, world
        self.stop_ids = turn_stop_ids(task, tokenizer, model_stop_ids)  # rank 0's engine's: a tool call's tag too
        self.engine, self.source = None, None
        self.commands = {"rollouts": self.start, "generate": lambda version, seed: self.source.next_rollouts(version, seed)}

    def take_weights(self, weights, version: int) -> None:
        if self.engine is None:
            self.engine = make_inference(self.engine_settings, weights, self.tokenizer,
                                         stop_ids=self.stop_ids, device=self.device)
            self.engine.turn_env = make_turn_env(self.task, self.tokenizer)
        else:
            self.engine.push_weights(weights, version)

    def start(self, batch_index: int) -> None:
        ledger = PromptLedger({"next_batch": batch_index, "pending": []})  # rank 0 keeps the run's ledger
        self.source = rank_rollouts(self.rollout, self.task, self.tokenizer, self.engine, ledger, self.world)

    def shutdown(self) -> None:
        if self.source is not None:
            self.source.shutdown()
        if self.engine is not None:
            self.engine.shutdown()
