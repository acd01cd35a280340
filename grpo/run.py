"""Everything a GRPO run holds, built once for both scripts: models, envs, loss, optimiser, logging.

The scripts differ only in how batches reach ``prepare`` / ``optimize``; this class holds the
state those steps share and the bookkeeping around them (eval, checkpoints, metrics, signals).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from tqdm import tqdm

from grpo import checkpoint as ckpt
from grpo.config import validate_config
from grpo.devices import allocate_devices
from grpo.envs import EVAL_FIELDS, TASK_ENVS, data_position, make_env, skip_to_position
from grpo.evaluation import evaluate
from grpo.inference import make_inference
from grpo.logger import RunLogger, profile_to
from grpo.models import (configure_attention_kernels, load_policy_model, load_reference_model, load_tokenizer,
                         stop_token_ids)
from grpo.rollouts import prepare_rollouts
from grpo.setup import REPO_ROOT, StopFlag, StopRequested, resolve_local_paths, resolved_config, seed_everything
from grpo.trainer import (GRPOObjective, make_optimizer, make_replay_buffer, make_scheduler, micro_batch_size,
                          optimize_on_batch)


class TrainingRun:
    def __init__(self, cfg, *, mode: str):
        self.cfg = cfg
        resolve_local_paths(cfg)
        validate_config(cfg)
        env_cls = TASK_ENVS[cfg.env.task]
        env_cls.load_split(cfg.env.dataset, cfg.env.train_split)  # bad data stops here, before any model loads
        self.num_eval_problems = min(cfg.eval.num_problems, len(env_cls.load_split(cfg.env.dataset, cfg.env.test_split)))
        self.alloc = allocate_devices(cfg, mode=mode)
        print(self.alloc.describe(), flush=True)
        self.train_device = self.alloc.torch_device("train")
        self.ref_device = self.alloc.torch_device("ref") if cfg.train.use_kl_to_ref else None
        seed_everything(cfg.seed)
        self.stop_flag = StopFlag()
        self.run_dir = HydraConfig.get().runtime.output_dir
        self.resume_payload = None
        if cfg.resume:
            ckpt_path, self.resume_payload = ckpt.find_checkpoint(
                str(cfg.resume), experiment_name=cfg.logging.experiment_name,
                search_roots=[REPO_ROOT / "outputs", REPO_ROOT / "multirun"])
            # continue in the original run dir: its metrics, checkpoints and wandb run
            self.run_dir = str(ckpt_path.parent.parent)
            ckpt.truncate_metrics(Path(self.run_dir) / "metrics.jsonl", self.resume_payload["step"])
            print(f"resuming from {ckpt_path} (step {self.resume_payload['step']}) into {self.run_dir}", flush=True)
        self.config = resolved_config(cfg) | {"device_allocation": self.alloc.as_dict()}

        configure_attention_kernels(cfg)
        self.tokenizer = load_tokenizer(cfg.model.name)
        self.policy_model = load_policy_model(cfg, self.tokenizer, self.train_device, shard_over=self.alloc.train)
        self.ref_model = load_reference_model(cfg, self.tokenizer, self.ref_device) if cfg.train.use_kl_to_ref else None
        self.stop_ids = stop_token_ids(self.tokenizer, self.policy_model.generation_config)
        # sync generates here; async generates in Ray workers and keeps a local engine on the
        # training device for greedy eval only
        self.rollout_devices = [str(self.alloc.torch_device("inference"))] if self.alloc.cpu else \
            [f"cuda:{i}" for i in self.alloc.inference]
        local_role = "inference" if mode == "sync" else "train"
        self.inference = make_inference(cfg, self.policy_model, self.tokenizer, self.alloc.torch_device(local_role))
        self.batches_per_step = cfg.train.dialog_turns_per_batch // cfg.env.num_envs

        self.env = make_env(cfg, self.tokenizer, split=cfg.env.train_split, repeats=cfg.env.repeats,
                            num_envs=cfg.env.num_envs)
        self.eval_env = make_env(cfg, self.tokenizer, split=cfg.env.test_split, repeats=1,
                                 num_envs=min(cfg.eval.batch_size, self.num_eval_problems), shuffle=False)

        self.loss_fn = GRPOObjective(cfg, self.policy_model)
        optim_steps_per_batch = cfg.train.epochs * cfg.train.dialog_turns_per_batch // cfg.train.optim_batch_size
        self.optimizer = make_optimizer(cfg, self.policy_model)
        self.scheduler = make_scheduler(cfg, self.optimizer, cfg.train.total_steps * optim_steps_per_batch)
        # bf16 needs no loss scaling; the scaler is kept (disabled) so checkpoints have one shape
        self.scaler = torch.amp.GradScaler(enabled=False)
        self.step = 0
        self.optim_steps = 0
        self.last_eval_step = None
        self.collector = None
        self._last_pool_stats: dict = {}
        self._last_stats_time = time.perf_counter()
        payload = self.resume_payload
        self.logger = RunLogger(self.run_dir, cfg, self.config,
                                wandb_run_id=payload.get("wandb_run_id") if payload else None)
        self.logger.log({"step": self.step if not payload else payload["step"], "event": "resume" if payload else "start",
                         **{f"devices/{k}": str(v) for k, v in self.alloc.as_dict().items()}})
        if payload:
            self._restore(payload)

    def _restore(self, payload: dict) -> None:
        ckpt.restore_training_state(payload, model=self.policy_model, optimizer=self.optimizer,
                                    scheduler=self.scheduler, scaler=self.scaler)  # RNG states last of all
        counters = payload["counters"]
        self.step, self.optim_steps = counters["step"], counters["optim_steps"]
        self.last_eval_step = counters.get("last_eval_step")
        self.inference.push_weights(self.policy_model, version=counters["policy_version"])

    def attach_collector(self, collector) -> None:
        """Sync: the collector's pending prompts are part of the state a checkpoint keeps."""
        self.collector = collector
        if self.resume_payload and self.resume_payload.get("collector_shuttle") is not None:
            # LLMCollector resets the env right after each step, so the next prompts are already
            # drawn; a resumed run starts from those, then from the same place in the stream.
            collector._shuttle = self.resume_payload["collector_shuttle"]
            skip_to_position(self.env, self.resume_payload["data_position"])

    # --- the GRPO step, in pieces the scripts call -------------------------------------------
    def steps(self):
        bar = tqdm(range(self.step + 1, self.cfg.train.total_steps + 1), desc="GRPO", unit="step",
                   disable=not self.cfg.logging.progress_bar, dynamic_ncols=True)
        for step in bar:
            self.step = step
            with profile_to(self.run_dir, step) if step == self.cfg.logging.profile_step else contextlib.nullcontext():
                yield step
            bar.set_postfix(self._postfix)
            self.stop_flag.raise_if_set()  # at a step boundary, after that step's eval and checkpoint

    def prepare(self, rollouts) -> tuple:
        """Collected rollouts -> dense training batch with reference log-probs and group advantages."""
        t0 = time.perf_counter()
        if "row_index" in rollouts.keys():
            stats = {"prompt_indices": sorted({int(i) for i in rollouts["row_index"].flatten().tolist()})}
        else:
            stats = {}
        batch, rollout_stats = prepare_rollouts(
            rollouts, pad_token_id=self.tokenizer.pad_token_id, stop_token_ids=self.stop_ids,
            ref_model=self.ref_model, ref_device=self.ref_device,
            micro_batch=micro_batch_size(self.cfg), kl_to_ref_coeff=self.cfg.train.kl_to_ref_coeff,
            kl_in_reward=not self.cfg.train.kl_coef_in_loss,
            policy_model=self.policy_model if self.cfg.train.inference_is_cap is not None else None,
            policy_device=self.train_device)
        return batch, stats | rollout_stats | {"reference_s": time.perf_counter() - t0}

    def optimize(self, samples) -> dict:
        t0 = time.perf_counter()
        stats = optimize_on_batch(make_replay_buffer(self.cfg, samples), self.loss_fn, self.optimizer, self.scheduler, self.scaler,
                                  self.cfg, self.train_device, self.policy_model)
        self.optim_steps += stats["optim_steps"]
        train_s = time.perf_counter() - t0
        return stats | {"train_s": train_s, "train_samples_per_s": self.cfg.train.dialog_turns_per_batch
                        * self.cfg.train.epochs / train_s}

    def rate_metrics(self, pool_stats: dict) -> dict:
        """Async: per-step deltas of the rollout pool's cumulative counters, as rates."""
        prev, now = self._last_pool_stats, time.perf_counter()
        elapsed = now - self._last_stats_time
        delta = {k: v - prev.get(k, 0) for k, v in pool_stats.items() if isinstance(v, (int, float))}
        self._last_pool_stats, self._last_stats_time = pool_stats, now
        return {
            "gen_samples_per_s": delta["collector_replies"] / elapsed,
            "gen_tokens_per_s": delta["collector_tokens"] / elapsed,
            "buffer_fill": pool_stats["buffer_fill"],
            "dropped_stale_batches": pool_stats["dropped_stale_batches"],
            "dropped_stale_replies": pool_stats["dropped_stale_replies"],
            "trainer_wait_s": delta["trainer_wait_s"],
            "collector_wait_s": delta["collector_put_wait_s"] + delta["collector_weight_apply_s"],
            "collector_weight_apply_s": delta["collector_weight_apply_s"],
            "collector_version_min": min(pool_stats["collector_versions"]),
            "weight_pushes_verified": pool_stats["weight_pushes_verified"],
            "weight_pushes_mismatched": pool_stats["weight_pushes_mismatched"],
        }

    # --- bookkeeping ----------------------------------------------------------------------------
    _postfix: dict = {}

    def log_step(self, step: int, metrics: dict, t0: float) -> None:
        metrics["step_time_s"] = time.perf_counter() - t0
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # this step's peak over the GPUs this process uses (generation usually sets it)
            metrics["gpu_peak_memory_gb"] = max(torch.cuda.max_memory_allocated(i)
                                                for i in range(torch.cuda.device_count())) / 2**30
            for i in range(torch.cuda.device_count()):
                torch.cuda.reset_peak_memory_stats(i)
        self.logger.log({"step": step, **metrics})
        self._postfix = {"reward": f"{metrics['reward']:.3f}", "kl": f"{metrics.get('kl_to_ref', 0):.4f}"}

    def evaluate_if_due(self, force: bool = False) -> None:
        freq = self.cfg.eval.frequency
        due = force or (freq and self.step % freq == 0) or self.step == self.cfg.train.total_steps
        if not due or self.last_eval_step == self.step:
            return
        t0 = time.perf_counter()
        result = evaluate(self.eval_env, self.inference.greedy_policy, self.num_eval_problems,
                          EVAL_FIELDS[self.cfg.env.task])
        self.logger.log({"step": self.step, **result, "eval/time_s": time.perf_counter() - t0})
        tqdm.write(f"step {self.step}: eval accuracy {result['eval/accuracy']:.3f} "
                   f"({result['eval/num_problems']} problems)")
        self.last_eval_step = self.step

    def checkpoint_if_due(self, force: bool = False) -> None:
        freq = self.cfg.train.checkpoint_frequency
        if force or (freq and self.step % freq == 0):
            path = ckpt.save_checkpoint(
                f"{self.run_dir}/{self.cfg.logging.checkpoint_dir}", self.step, model=self.policy_model,
                optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
                counters={"step": self.step, "optim_steps": self.optim_steps, "policy_version": self.inference.version,
                          "last_eval_step": self.last_eval_step},
                resolved_config=self.config, extra={
                    "wandb_run_id": self.logger.wandb_run_id,
                    # sync only: the prompt stream lives here (async workers draw their own)
                    "data_position": data_position(self.env) if self.collector is not None else None,
                    "collector_shuttle": getattr(self.collector, "_shuttle", None),
                },
                keep_last=self.cfg.logging.keep_last)
            tqdm.write(f"step {self.step}: checkpoint {path}")

    @contextlib.contextmanager
    def guard(self):
        """On success: final eval and checkpoint. On SIGTERM/Ctrl-C: checkpoint, then exit non-zero."""
        exit_code = 1
        try:
            yield
            self.evaluate_if_due()
            self.checkpoint_if_due(force=True)
            exit_code = 0
        except StopRequested as stop:
            tqdm.write(f"stopping after step {self.step}: {stop}; writing a checkpoint")
            self.checkpoint_if_due(force=True)
            raise SystemExit(stop.exit_code)
        finally:
            self.inference.shutdown()
            self.logger.close(exit_code)
