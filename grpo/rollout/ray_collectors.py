"""Async GRPO's rollout workers: Ray actors that generate the prompt batches the trainer assigns.

The trainer owns the prompt stream (a ``grpo.tasks.data.PromptLedger``) and hands each worker batch
indices; a worker builds batch ``k`` of the stream by index, generates ``env.num_envs`` replies
(complete GRPO groups) with the latest weights it was sent, and returns them stamped with that
weights version. At most ``train.buffer_size`` batches are assigned beyond one per worker, so
workers never run further ahead than that (back-pressure). The trainer takes each worker's batches
in the order it assigned them and drops any generated more than ``train.max_policy_lag`` optimiser
steps ago. TorchRL's ``RayReplayBuffer`` samples without tracking the order or age of items, so
staleness could not be bounded with it, nor could a worker's lost batches be told apart.

A worker that dies (killed, out of memory) or raises is replaced by a new one holding the current
weights, and the batches it held are assigned again before any new one, up to
``train.max_worker_restarts`` times per run. A user error it raises (a reward function's bad return, or
anything leaving the user's code) ends the run instead: a new worker would fail the same way.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

from dataclasses import dataclass

import ray
import torch

from grpo.inference.generation import EngineSettings, as_state_dict, tensor_place
from grpo.inference.weight_transfer import PublishedWeights, one_host, receive
from grpo.process.console import quiet_libraries, say
from grpo.process.errors import UserError
from grpo.process.ray_placement import SAME_GPU_IDS, RaySettings, assigned_gpu, gpu_share, see_only
from grpo.process.setup import freeze_long_lived_objects, raise_if_stop_signalled, ray_pythonpath
from grpo.rollout.dynamic_sampling import env_batches_per_draw
from grpo.rollout.settings import RolloutSettings
from grpo.tasks.data import PromptLedger, serve_from
from grpo.tasks.settings import TaskSettings
from grpo.tasks.user_rewards import take_reward_seconds
from grpo.training.models import torch_dtype
from grpo.training.replies import Replies

GENERATION_STATS = ("replies", "tokens", "idle_s", "weight_apply_s", "reward_s", "engine_s", "env_s")


@dataclass(frozen=True)
class PoolSettings:
    """What the rollout pool and its workers read of the config, once: ``RolloutPool`` takes these, never the config."""
    engine: EngineSettings          # each worker's engine
    task: TaskSettings              # each worker's env
    rollout: RolloutSettings        # a worker's batch (env.num_envs replies) and the batches a step draws
    ray: RaySettings                # the workers, and the GPUs Ray gives them
    buffer_size: int                # batches assigned beyond the one each worker generates
    max_policy_lag: int             # batches generated more optimiser steps ago than this are dropped
    weight_update_frequency: int    # optimiser steps between weight pushes
    max_worker_restarts: int        # failed workers replaced per run

    @classmethod
    def from_config(cls, cfg) -> PoolSettings:
        train = cfg.train
        return cls(engine=EngineSettings.from_config(cfg), task=TaskSettings.from_config(cfg),
                   rollout=RolloutSettings.from_config(cfg), ray=RaySettings.from_config(cfg),
                   buffer_size=train.buffer_size, max_policy_lag=train.max_policy_lag,
                   weight_update_frequency=train.weight_update_frequency,
                   max_worker_restarts=train.max_worker_restarts)

    @property
    def worker_sees_own_gpu_only(self) -> bool:
        """In-process vLLM runs on cuda:0 of what its process sees, so a vLLM worker sees its own GPU alone
        (``ray_placement.see_only``), and so not the trainer's tensors' GPU that CUDA IPC hands over."""
        return self.engine.backend == "vllm"


@ray.remote(concurrency_groups={"generate": 1})  # batches one at a time; weights arrive on another thread meanwhile
class RolloutWorker:
    def __init__(self, settings: PoolSettings, worker_id: int, device: str, gpu_pool: list[int] | None,
                 stop_ids: list[int], weights, version: int, checksum: int):
        """``device``: ``cpu``, or ``cuda``: the GPU Ray assigned this worker, named as ``gpu_pool`` says
        (``grpo.process.ray_placement.worker_gpu``)."""
        quiet_libraries()  # Ray forwards a worker's output to the driver's console, through its progress bar
        self.start_error: UserError | None = None
        try:
            self._start(settings, worker_id, device, gpu_pool, stop_ids, weights, version, checksum)
        except UserError as err:  # bad config or data (a model folder this node lacks): Ray restarts a worker whose
            self.start_error = err  # __init__ raised, so the first batch raises it: the run ends with its one line

    def _start(self, settings: PoolSettings, worker_id: int, device: str, gpu_pool: list[int] | None,
               stop_ids: list[int], weights, version: int, checksum: int) -> None:
        from tensordict import set_list_to_stack

        from grpo.inference.engine import make_inference
        from grpo.process.setup import seed_everything
        from grpo.tasks.envs import make_collector, make_env
        from grpo.tasks.tool_env import make_turn_env
        from grpo.training.models import configure_torch, load_tokenizer

        set_list_to_stack(True).set()
        engine, task, rollout = settings.engine, settings.task, settings.rollout
        seed_everything(engine.seed + 1000 * (worker_id + 1))  # different samples per worker
        self.device = torch_device = assigned_gpu(gpu_pool) if device == "cuda" else torch.device(device)
        if device == "cuda" and settings.worker_sees_own_gpu_only:
            self.device = torch_device = see_only(torch_device)
        self._own_gpu_current()
        configure_torch(on_gpu=device == "cuda")
        tokenizer = load_tokenizer(engine.model_name)
        # the engine loads model.name itself (vLLM: no transformers model at all); the trainer's weights,
        # pending below, replace its weights before the first batch
        self.inference = make_inference(engine, None, tokenizer, device=torch_device, stop_ids=stop_ids)
        self.inference.turn_env = make_turn_env(task, tokenizer)
        self.env = make_env(task, tokenizer, split=task.train_split, repeats=rollout.repeats, num_envs=rollout.num_envs)
        self.collector = make_collector(self.env, self.inference.policy, rollout.num_envs)
        self.batches = iter(self.collector)
        self._lock = threading.Lock()
        self._pending = (receive(weights, torch_device), version, checksum)  # the trainer's weights at its start
        self._idle_since = time.perf_counter()

    def set_weights(self, weights, version: int, checksum: int) -> None:
        """New weights (``grpo.inference.weight_transfer``), applied before the next batch; returns once they are
        this worker's own copy, while a batch may be generating."""
        if self.start_error is not None:
            return
        self._own_gpu_current()
        weights = receive(weights, self.device)
        with self._lock:
            self._pending = (weights, version, checksum)

    @ray.method(concurrency_group="generate")
    def generate(self, batch_index: int) -> tuple[Replies, int, dict]:
        """Replies to stream batch ``batch_index``, the weights version that wrote them, and this call's stats.
        ``Replies``, not the collector's tensordict: pickling that for Ray held the trainer up (replies.py)."""
        if self.start_error is not None:
            raise self.start_error
        stats = dict.fromkeys(GENERATION_STATS, 0.0) | {"pushes_verified": 0, "pushes_mismatched": 0}
        stats["idle_s"] = time.perf_counter() - self._idle_since
        self._own_gpu_current()
        self._apply_pending_weights(stats)
        serve_from(self.env, self.collector, batch_index)
        engine_s, env_s = self.inference.generate_s, self.inference.policy.env_seconds
        batch = Replies.from_collector(next(self.batches))
        stats["engine_s"] = self.inference.generate_s - engine_s
        stats["env_s"] = self.inference.policy.env_seconds - env_s  # waiting on the turn environment (tools)
        stats["reward_s"] = take_reward_seconds(self.env)
        stats["replies"] = len(batch)
        stats["tokens"] = int(batch.reply_lengths.sum())
        freeze_long_lived_objects()  # the first batch built this worker's decode graphs: the rest lives on
        self._idle_since = time.perf_counter()
        return batch, self.inference.version, stats

    def _own_gpu_current(self) -> None:
        """This worker's GPU made the calling thread's current one (each concurrency group runs in a thread of its
        own): work that names no device opens a CUDA context on the current one, cuda:0 by default, another
        process's GPU (4xH200, a cluster: each worker held a context on rank 1's GPU as well as its own)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _apply_pending_weights(self, stats: dict) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            weights, version, checksum = pending
            stats["weight_apply_s"] = self.inference.push_weights(weights, version=version)
            # proof, not assumption: the engine, read back, now holds exactly the pushed weights
            verified = self.inference.weights_checksum() == checksum
            stats["pushes_verified" if verified else "pushes_mismatched"] += 1


class RolloutWorkersLost(UserError):
    """Rollout workers kept failing until ``train.max_worker_restarts`` restarts were used up. The run's
    guard then writes its emergency checkpoint: the step in progress took batches but trained none."""


def failure_reason(err: ray.exceptions.RayError) -> str:
    """One line: the exception a worker raised, or how it died."""
    if isinstance(err, ray.exceptions.RayTaskError):
        return f"{type(err.cause).__name__}: {err.cause}".strip().splitlines()[0]
    return str(err).strip().splitlines()[0]


class RolloutPool:
    """Starts the workers, assigns them prompt batches, hands the trainer their replies, pushes
    weights, and replaces workers that fail."""

    def __init__(self, settings: PoolSettings, devices: list[torch.device], stop_ids: list[int], ledger: PromptLedger,
                 weights, version: int):
        """``weights``: what the workers start from (``Trainer.engine_weights``)."""
        self.settings, self.ledger = settings, ledger
        workers = settings.ray.num_collectors
        self.batches_per_step = env_batches_per_draw(settings.rollout)
        self.capacity = settings.buffer_size + workers  # batches assigned and not yet taken
        self.weights_dtype = torch_dtype(settings.engine.dtype, torch.device(devices[0]))
        on_gpus = devices[0].type == "cuda"
        # a local Ray's GPUs are the inference GPUs in order (ray_placement.local_ray_resources); a cluster's its nodes'
        gpu_pool = [d.index for d in devices] if on_gpus and settings.ray.address is None else None
        self._worker_args = (settings, devices[0].type, gpu_pool, stop_ids)
        # one GPU each, which Ray assigns; workers that outnumber the GPUs share them, as evenly as whole workers go
        self._worker_resources = {"num_cpus": 1} | (
            {"num_gpus": gpu_share(workers, len(devices))} if on_gpus else {})
        snapshot = self._snapshot(as_state_dict(weights))
        # GPU to GPU where the workers share this host (Ray's one node), else through the object store
        self.cuda_ipc = (one_host() and all(t.is_cuda for t in snapshot.values()) and on_gpus
                         and not settings.worker_sees_own_gpu_only)
        self._weights = PublishedWeights(snapshot, version, self.cuda_ipc)  # what a (re)started worker begins with
        self.pushed_version = version
        self.workers = [self._start_worker(i) for i in range(workers)]
        self.assigned: list[tuple[ray.ObjectRef, int, int]] = []  # (replies, worker, batch index), in assignment order
        self.taken: list[int] = []  # batch indices the step in progress took (trained or dropped)
        self.restarts = 0
        self.dropped_batches = 0
        self.dropped_replies = 0
        self.pushes = Counter()
        self.versions: dict[int, int] = {}  # each worker's weights version, as of its last batch taken
        self._since_metrics = dict.fromkeys(GENERATION_STATS, 0.0) | {"trainer_wait_s": 0.0}
        self.lags: list[int] = []  # of the batches handed out since the last step_metrics()
        self._last_metrics_time = time.perf_counter()
        self._push_thread: threading.Thread | None = None
        self._push_error: Exception | None = None
        self._assign()

    def _start_worker(self, worker_id: int):
        settings, device, gpu_pool, stop_ids = self._worker_args
        runtime_env = {"env_vars": {"PYTHONPATH": ray_pythonpath(),
                                    # workers address GPUs by the allocation's logical ids, as the trainer does: CUDA
                                    # IPC handles name the device by its index
                                    **SAME_GPU_IDS,
                                    # read by the worker's first vLLM import, before its engine starts
                                    "VLLM_LOGGING_LEVEL": self.settings.engine.vllm_log_level}}
        published = self._weights
        return RolloutWorker.options(**self._worker_resources, runtime_env=runtime_env).remote(
            settings, worker_id, device, gpu_pool, stop_ids, published.message(), published.version,
            published.checksum)

    def _assign(self) -> None:
        """Fill the pipeline: each new batch index goes to the worker holding the fewest."""
        while len(self.assigned) < self.capacity:
            load = Counter(worker for _, worker, _ in self.assigned)
            worker = min(range(len(self.workers)), key=lambda w: load[w])
            index = self.ledger.take()
            self.assigned.append((self.workers[worker].generate.remote(index), worker, index))

    def next_rollouts(self, trainer_version: int) -> Replies:
        """One step's rollouts: ``train.dialog_turns_per_batch`` replies in whole worker batches."""
        return Replies.cat([self._next_batch(trainer_version) for _ in range(self.batches_per_step)])

    def commit(self) -> None:
        """The step that took the last batches completed: from now on they count as consumed."""
        self.ledger.consume(self.taken)
        self.taken = []

    def after_update(self, weights: Callable[[], object], version: int) -> dict:
        """A push every ``train.weight_update_frequency`` optimiser steps (``grpo.rollout.local_rollouts``: what a
        rollout source does); ``weights()``: the policy, or its whole weights gathered over the trainer's ranks
        (``Trainer.engine_weights``), asked only when a push is due."""
        if version - self.pushed_version < self.settings.weight_update_frequency:
            return {}
        self.pushed_version = version
        return {"weight_sync_s": self.push_weights(as_state_dict(weights()), version=version)}

    def state(self) -> dict:
        return {"prompt_stream": self.ledger.state()}

    def _next_batch(self, trainer_version: int):
        """The next batch generated at most ``train.max_policy_lag`` optimiser steps ago."""
        t0 = time.perf_counter()
        while True:
            oldest = {}  # each worker's first assigned batch: a worker's batches are taken in the order assigned
            for entry in self.assigned:
                oldest.setdefault(entry[1], entry)
            by_ref = {entry[0]: entry for entry in oldest.values()}
            ready, _ = ray.wait(list(by_ref), num_returns=1, timeout=1.0)  # returns now and then: Ctrl-C stays live
            if not ready:
                raise_if_stop_signalled("rollout workers")  # whose reward function may hang
                continue
            entry = by_ref[ready[0]]
            self.assigned.remove(entry)
            _, worker, index = entry
            try:
                batch, version, stats = ray.get(ready[0])
            except ray.exceptions.RayError as err:  # the worker died (RayActorError) or raised (RayTaskError)
                if isinstance(getattr(err, "cause", None), UserError):  # bad input (a reward function's return):
                    raise err.cause from None                           # a restart would only fail the same way
                self._replace(worker, index, err)
                continue
            self._assign()
            self.taken.append(index)
            self.versions[worker] = version
            self.pushes.update(verified=stats["pushes_verified"], mismatched=stats["pushes_mismatched"])
            for key in GENERATION_STATS:
                self._since_metrics[key] += stats[key]
            lag = trainer_version - version
            if lag > self.settings.max_policy_lag:
                self.dropped_batches += 1
                self.dropped_replies += stats["replies"]
                continue
            self._since_metrics["trainer_wait_s"] += time.perf_counter() - t0
            self.lags.append(lag)
            return batch

    def _replace(self, worker: int, index: int, err: ray.exceptions.RayError) -> None:
        """Start a new worker in place of a failed one; the batches it held are assigned again first."""
        lost = [index] + [i for _, w, i in self.assigned if w == worker]
        self.assigned = [entry for entry in self.assigned if entry[1] != worker]
        self.ledger.release(lost)
        ray.kill(self.workers[worker], no_restart=True)
        if isinstance(err, ray.exceptions.RayTaskError):
            say(str(err), file=sys.stderr)  # the worker's traceback: what the user needs to fix a raise
        limit = self.settings.max_worker_restarts
        if self.restarts >= limit:
            raise RolloutWorkersLost(f"rollout worker {worker} failed ({failure_reason(err)}) with the run's "
                                     f"train.max_worker_restarts={limit} restart(s) used up; see why above (out of "
                                     "memory? killed?), then resume the run")
        self.restarts += 1
        self.wait_for_push()  # a push in flight may be replacing the weights the new worker starts from
        say(f"rollout worker {worker} failed ({failure_reason(err)}); restart {self.restarts} of {limit}, with "
            f"weights version {self._weights.version}; its prompt batches {sorted(lost)} are generated again",
            file=sys.stderr)
        self.workers[worker] = self._start_worker(worker)
        self._assign()

    def _snapshot(self, weights: dict) -> dict:
        """A device-side copy in the workers' dtype, which training may then change. Tied weights stay one
        tensor: the engines hold them once, and the checksum counts them once."""
        copies, snapshot = {}, {}
        for name, tensor in weights.items():
            place = tensor_place(tensor)
            if place not in copies:
                copies[place] = tensor.detach().to(self.weights_dtype, copy=True)
            snapshot[name] = copies[place]
        return snapshot

    def push_weights(self, weights: dict, version: int) -> float:
        """Hand new weights to every worker; returns the seconds the trainer was held up.

        The trainer only takes a snapshot; a thread checksums it and sends it (``grpo.inference.weight_transfer``)
        while training goes on. Sending 1 GB through Ray's object store took 3.3 s on a 0.5B model,
        all of it blocking the trainer. At most one push is in flight: the next one waits for it and
        re-raises its error.
        """
        t0 = time.perf_counter()
        self.wait_for_push()
        self._push_thread = threading.Thread(target=self._send, args=(self._snapshot(weights), version), daemon=True)
        self._push_thread.start()
        return time.perf_counter() - t0

    def _send(self, snapshot: dict, version: int) -> None:
        try:
            self._weights = published = PublishedWeights(snapshot, version, self.cuda_ipc)
            for ref in [w.set_weights.remote(published.message(), version, published.checksum) for w in self.workers]:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    pass  # a dead worker: its batches fail too, and its replacement starts from self._weights
        except Exception as err:  # noqa: BLE001 - handed to the trainer thread by wait_for_push
            self._push_error = err

    def wait_for_push(self) -> None:
        """Block until the push in flight (if any) reached every worker; raise its error."""
        if self._push_thread is not None:
            self._push_thread.join()
            self._push_thread = None
        if self._push_error is not None:
            err, self._push_error = self._push_error, None
            raise err

    def step_metrics(self) -> dict:
        """Since the last call: the handed-out batches' policy lag, generation rates, waits, drops, restarts."""
        since, self._since_metrics = self._since_metrics, dict.fromkeys(self._since_metrics, 0.0)
        elapsed = time.perf_counter() - self._last_metrics_time
        self._last_metrics_time = time.perf_counter()
        lags, self.lags = self.lags, []
        finished, _ = ray.wait([entry[0] for entry in self.assigned], num_returns=len(self.assigned), timeout=0)
        return {
            "policy_lag_mean": sum(lags) / len(lags), "policy_lag_max": max(lags),
            "gen_samples_per_s": since["replies"] / elapsed, "gen_tokens_per_s": since["tokens"] / elapsed,
            "buffer_fill": len(finished),
            "dropped_stale_batches": self.dropped_batches, "dropped_stale_replies": self.dropped_replies,
            "trainer_wait_s": since["trainer_wait_s"],
            "collector_wait_s": since["idle_s"] + since["weight_apply_s"],
            "collector_weight_apply_s": since["weight_apply_s"],
            "reward_s": since["reward_s"],  # in the workers' reward functions, summed over the batches taken
            "generation_engine_s": since["engine_s"],  # in the workers' engines' generate calls, likewise
            "generation_env_s": since["env_s"],  # waiting on their turn environments (tools), likewise
            "collector_version_min": min(self.versions.values()),
            "weight_pushes_verified": self.pushes["verified"], "weight_pushes_mismatched": self.pushes["mismatched"],
            "worker_restarts": self.restarts,
        }

    def shutdown(self) -> None:
        if self._push_thread is not None:
            self._push_thread.join(timeout=60)
        for w in self.workers:
            ray.kill(w)
