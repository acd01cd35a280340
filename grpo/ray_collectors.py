"""Async GRPO's rollout workers: Ray actors that keep generating while the trainer optimises.

Each worker wraps TorchRL's ``LLMCollector`` over its own copy of the policy and puts whole
batches (``env.num_envs`` replies = complete GRPO groups), stamped with the weights version
that generated them, into a bounded FIFO (``train.buffer_size`` batches). A full FIFO makes
workers wait (back-pressure). TorchRL's ``RayReplayBuffer`` samples without tracking the
order or age of items, so staleness could not be bounded; a FIFO of stamped batches lets the
trainer drop those older than ``train.max_policy_lag`` optimiser steps.
"""

from __future__ import annotations

import threading
import time

import ray
import torch
from omegaconf import OmegaConf
from ray.util.queue import Empty, Queue

from tensordict import lazy_stack

from grpo.generation import weights_checksum
from grpo.models import torch_dtype
from grpo.setup import ray_pythonpath


@ray.remote(max_concurrency=2)  # one thread generates, the other receives weights and stop requests
class RolloutWorker:
    def __init__(self, cfg_dict: dict, worker_id: int, device: str, stop_ids: list[int]):
        from tensordict import set_list_to_stack

        from grpo.envs import make_collector, make_env
        from grpo.inference import make_inference
        from grpo.models import configure_attention_kernels, load_causal_lm, load_tokenizer
        from grpo.setup import seed_everything

        set_list_to_stack(True).set()
        cfg = OmegaConf.create(cfg_dict)
        seed_everything(cfg.seed + 1000 * (worker_id + 1))  # different samples per worker
        self.worker_id = worker_id
        torch_device = torch.device(device)
        configure_attention_kernels(cfg)
        tokenizer = load_tokenizer(cfg.model.name)
        model = load_causal_lm(cfg.model.name, tokenizer, dtype=torch_dtype(cfg.inference_model.dtype, torch_device),
                               device=torch_device).eval().requires_grad_(False)
        self.inference = make_inference(cfg, model, tokenizer, device=torch_device, stop_ids=stop_ids)
        env = make_env(cfg, tokenizer, split=cfg.env.train_split, repeats=cfg.env.repeats, num_envs=cfg.env.num_envs)
        self.collector = make_collector(env, self.inference.policy, cfg.env.num_envs)
        self._lock = threading.Lock()
        self._pending = None
        self._stop = False
        self.stats = {"batches": 0, "replies": 0, "tokens": 0, "put_wait_s": 0.0,
                      "weight_apply_s": 0.0, "version": 0, "pushes_verified": 0, "pushes_mismatched": 0}

    def set_weights(self, weights: dict, version: int, checksum: float) -> None:
        with self._lock:
            self._pending = (weights, version, checksum)

    def stop(self) -> None:
        self._stop = True

    def get_stats(self) -> dict:
        return dict(self.stats)

    def run(self, queue: Queue) -> int:
        batches = iter(self.collector)
        while not self._stop:
            self._apply_pending_weights()
            batch = next(batches).reshape(-1)
            tokens = sum(s["tokens", "response"].shape[-1] for s in batch.unbind(0))
            version = self.inference.version
            t1 = time.perf_counter()
            while not self._stop:
                try:
                    queue.put((batch, version), timeout=1.0)
                    break
                except Exception:  # ray's queue raises Full on timeout; retry so stop() is honoured
                    continue
            self.stats["put_wait_s"] += time.perf_counter() - t1
            self.stats["batches"] += 1
            self.stats["replies"] += batch.numel()
            self.stats["tokens"] += tokens
        return self.stats["batches"]

    def _apply_pending_weights(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            weights, version, checksum = pending
            self.stats["weight_apply_s"] += self.inference.push_weights(weights, version=version)
            self.stats["version"] = version
            # proof, not assumption: the generating model now holds exactly the pushed weights
            applied = weights_checksum(self.inference.model.state_dict())
            self.stats["pushes_verified" if applied == checksum else "pushes_mismatched"] += 1


class CollectorError(RuntimeError):
    """A rollout worker died or raised; the message carries its error (not a UserError: its traceback
    is the worker's, which the user needs)."""


class RolloutPool:
    """Starts the workers, hands the trainer fresh batches, pushes weights, and watches worker health."""

    def __init__(self, cfg, devices: list[torch.device], stop_ids: list[int]):
        self.cfg = cfg
        self.batches_per_step = cfg.train.dialog_turns_per_batch // cfg.env.num_envs
        self.weights_dtype = torch_dtype(cfg.inference_model.dtype, torch.device(devices[0]))
        self.queue = Queue(maxsize=cfg.train.buffer_size)
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
        runtime_env = {"env_vars": {"PYTHONPATH": ray_pythonpath(),
                                    # workers address GPUs by the allocation's logical ids
                                    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        self.workers = [
            RolloutWorker.options(num_cpus=1, runtime_env=runtime_env).remote(cfg_dict, i, str(devices[i % len(devices)]), stop_ids)
            for i in range(cfg.train.num_collectors)
        ]
        self.runs = {w.run.remote(self.queue): i for i, w in enumerate(self.workers)}
        self.dropped_batches = 0
        self.dropped_replies = 0
        self.trainer_wait_s = 0.0
        self.lags: list[int] = []  # of the batches handed out since the last step_metrics()
        self._last_stats, self._last_stats_time = {}, time.perf_counter()
        self._push_thread: threading.Thread | None = None
        self._push_error: Exception | None = None

    def check_workers(self) -> None:
        """Raise at once if a worker's run loop ended with an error (crash, OOM, killed actor)."""
        done, _ = ray.wait(list(self.runs), timeout=0, num_returns=len(self.runs))
        for ref in done:
            try:
                ray.get(ref)
                raise CollectorError(f"rollout worker {self.runs[ref]} stopped unexpectedly")
            except ray.exceptions.RayError as err:
                raise CollectorError(f"rollout worker {self.runs[ref]} failed: {err}") from err

    def _get_all(self, method: str, *args) -> list:
        """Call ``method`` on every worker; a dead worker becomes a CollectorError naming it."""
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        results = []
        for i, ref in enumerate(refs):
            try:
                results.append(ray.get(ref, timeout=120))
            except ray.exceptions.RayError as err:
                raise CollectorError(f"rollout worker {i} failed: {err}") from err
        return results

    def next_rollouts(self, trainer_version: int):
        """One step's rollouts: ``train.dialog_turns_per_batch`` replies in whole worker batches."""
        batches = [self._next_batch(trainer_version) for _ in range(self.batches_per_step)]
        return batches[0] if len(batches) == 1 else lazy_stack([s for b in batches for s in b.unbind(0)])

    def _next_batch(self, trainer_version: int):
        """The next batch generated at most ``train.max_policy_lag`` optimiser steps ago."""
        t0 = time.perf_counter()
        while True:
            self.check_workers()
            try:
                batch, version = self.queue.get(timeout=1.0)
            except Empty:
                continue
            lag = trainer_version - version
            if lag > self.cfg.train.max_policy_lag:
                self.dropped_batches += 1
                self.dropped_replies += batch.numel()
                continue
            self.trainer_wait_s += time.perf_counter() - t0
            self.lags.append(lag)
            return batch

    def push_weights(self, weights: dict, version: int) -> float:
        """Hand new weights to every worker; returns the seconds the trainer was held up.

        The trainer only takes a snapshot (a device-side copy in the workers' dtype); a thread
        checksums it, moves it to the host and sends it, while training goes on. Sending 1 GB
        through Ray's object store took 3.3 s on a 0.5B model, all of it blocking the trainer.
        At most one push is in flight: the next one waits for it and re-raises its error.
        """
        t0 = time.perf_counter()
        self.wait_for_push()
        snapshot = {k: v.detach().to(self.weights_dtype, copy=True) for k, v in weights.items()}
        self._push_thread = threading.Thread(target=self._send, args=(snapshot, version), daemon=True)
        self._push_thread.start()
        return time.perf_counter() - t0

    def _send(self, snapshot: dict, version: int) -> None:
        try:
            checksum = weights_checksum(snapshot)  # where the weights are: on a GPU it takes milliseconds
            host = {k: v.cpu() for k, v in snapshot.items()}
            self._get_all("set_weights", ray.put(host), version, checksum)
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
        """Since the last call: the handed-out batches' policy lag, generation rates, waits and drops."""
        per_worker = self._get_all("get_stats")
        now = {key: sum(w[key] for w in per_worker) for key in ("replies", "tokens", "put_wait_s", "weight_apply_s")}
        now["trainer_wait_s"] = self.trainer_wait_s
        delta = {key: value - self._last_stats.get(key, 0) for key, value in now.items()}
        elapsed = time.perf_counter() - self._last_stats_time
        lags, self.lags = self.lags, []
        self._last_stats, self._last_stats_time = now, time.perf_counter()
        return {
            "policy_lag_mean": sum(lags) / len(lags), "policy_lag_max": max(lags),
            "gen_samples_per_s": delta["replies"] / elapsed, "gen_tokens_per_s": delta["tokens"] / elapsed,
            "buffer_fill": self.queue.qsize(),
            "dropped_stale_batches": self.dropped_batches, "dropped_stale_replies": self.dropped_replies,
            "trainer_wait_s": delta["trainer_wait_s"],
            "collector_wait_s": delta["put_wait_s"] + delta["weight_apply_s"],
            "collector_weight_apply_s": delta["weight_apply_s"],
            "collector_version_min": min(w["version"] for w in per_worker),
            "weight_pushes_verified": sum(w["pushes_verified"] for w in per_worker),
            "weight_pushes_mismatched": sum(w["pushes_mismatched"] for w in per_worker),
        }

    def shutdown(self) -> None:
        if self._push_thread is not None:
            self._push_thread.join(timeout=60)
        for w in self.workers:
            try:
                w.stop.remote()
            except Exception:
                pass
        try:
            ray.wait(list(self.runs), timeout=10, num_returns=len(self.runs))
        finally:
            for w in self.workers:
                ray.kill(w)
