"""What a GRPO run holds, however its rollouts arrive: checks, devices, models, the GRPO step, and the
bookkeeping around it (eval, checkpoints, metrics, signals). The scripts add how rollouts reach it.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from tqdm import tqdm

from grpo import checkpoint as ckpt
from grpo.config import validate_config, warn_if_too_few_rows
from grpo.devices import allocate_devices
from grpo.envs import EVAL_FIELDS, check_prompt_lengths, check_prompt_text, load_splits, make_env
from grpo.errors import ConfigError, UserError
from grpo.evaluation import evaluate
from grpo.export import export_model
from grpo.inference import make_inference
from grpo.logger import RunLogger, profile_to, read_metrics, reply_samples
from grpo.models import (configure_attention_kernels, load_policy_model, load_reference_model, load_tokenizer,
                         stop_token_ids)
from grpo.setup import (REPO_ROOT, RunDirClaim, StopFlag, StopRequested, resolve_local_paths, resolved_config,
                        seed_everything, write_hydra_record)
from grpo.step import GRPOSettings, GRPOStep


# shown on the console after eval/accuracy where the task reports them (all of them in metrics.jsonl)
EVAL_SHOWN = ("eval/strict_accuracy", "eval/flexible_accuracy", "eval/answer_rate", "eval/truncated_fraction")


class TrainingRun:
    """``dedicated_inference``: generation GPUs belong to rollout workers elsewhere, so this process's
    own engine (used for eval only) sits on the training GPU; otherwise it generates the rollouts."""

    def __init__(self, cfg, *, inference_engines: int, dedicated_inference: bool):
        task_config = OmegaConf.to_yaml(cfg)  # as Hydra composed it: the run dir's .hydra/config.yaml
        resolve_local_paths(cfg)
        validate_config(cfg)
        splits = load_splits(cfg)  # bad data, and reward functions that cannot take its rows, stop here
        warn_if_too_few_rows(cfg, len(splits[cfg.env.train_split]))
        self.num_eval_problems = min(cfg.eval.num_problems, len(splits[cfg.env.test_split]))
        self.cfg = cfg
        self.devices = allocate_devices(cfg, inference_engines=inference_engines, dedicated_inference=dedicated_inference)
        print(self.devices.describe(), flush=True)
        seed_everything(cfg.seed)
        self.run_dir, self.resume_payload = HydraConfig.get().runtime.output_dir, None
        self.last_checkpoint = None  # (step, path) of the newest checkpoint this run can continue from
        self.stop_flag = StopFlag(self.last_checkpoint_note)
        # train.total_steps=0 evaluates model.name or resume='s checkpoint in a run dir of its own, and trains nothing
        self.eval_only = cfg.train.total_steps == 0
        if cfg.resume:
            ckpt_path, self.resume_payload = ckpt.find_checkpoint(
                str(cfg.resume), experiment_name=cfg.logging.experiment_name,
                overrides=list(HydraConfig.get().overrides.task),
                search_roots=[REPO_ROOT / "outputs", REPO_ROOT / "multirun"])
            ckpt.check_resumable(ckpt_path, self.resume_payload, cfg)
            self.last_checkpoint = (self.resume_payload["step"], ckpt_path)
        if cfg.resume and not self.eval_only:
            # continue in the original run dir: its metrics, checkpoints and wandb run
            self.run_dir = str(ckpt_path.parent.parent)
        self.run_dir_claim = RunDirClaim(Path(self.run_dir))  # before this run writes anything into it
        try:
            self._start(cfg, splits, task_config, dedicated_inference=dedicated_inference)
        except BaseException:
            self.run_dir_claim.release()
            raise

    def _start(self, cfg, splits: dict, task_config: str, *, dedicated_inference: bool) -> None:
        """The rest of the start, in the run dir this run holds: checks, models, optimiser, logger."""
        payload = self.resume_payload
        if payload and not self.eval_only:  # its .hydra/ stays that of the command that started it (resume=auto's match)
            for rows in ("metrics.jsonl", "samples.jsonl"):
                ckpt.truncate_metrics(Path(self.run_dir) / rows, payload["step"])
            print(f"resuming from {self.last_checkpoint[1]} (step {payload['step']}) into {self.run_dir}", flush=True)
        elif (Path(self.run_dir) / "metrics.jsonl").exists():
            raise ConfigError(f"hydra.run.dir={self.run_dir} already holds a run (its metrics.jsonl and checkpoints "
                              f"would be mixed with this one's); pass resume={self.run_dir} to continue it, or another "
                              "hydra.run.dir.")
        else:
            write_hydra_record(Path(self.run_dir), task_config)
        if self.eval_only:
            print(f"train.total_steps=0: evaluating {self.last_checkpoint[1] if payload else cfg.model.name} only, "
                  f"into {self.run_dir}", flush=True)
        self.resolved_config = resolved_config(cfg) | {"device_allocation": self.devices.as_dict()}

        configure_attention_kernels(cfg)
        self.tokenizer = load_tokenizer(cfg.model.name)
        check_prompt_lengths(cfg, self.tokenizer, splits)  # before any model loads: a too-long prompt hangs mid-run
        check_prompt_text(cfg, self.tokenizer, splits)
        self.policy_model = load_policy_model(cfg, self.tokenizer, self.devices.torch_device("train"),
                                              shard_over=self.devices.train)
        ref_model = load_reference_model(cfg, self.tokenizer, self.devices.torch_device("ref"),
                                         shard_over=self.devices.ref) if cfg.train.use_kl_to_ref else None
        self.stop_ids = stop_token_ids(self.tokenizer, self.policy_model.generation_config)
        self.inference = make_inference(cfg, self.policy_model, self.tokenizer, stop_ids=self.stop_ids,
                                        device=self.devices.torch_device("train" if dedicated_inference else "inference"))
        self.eval_env = make_env(cfg, self.tokenizer, split=cfg.env.test_split, repeats=1,
                                 num_envs=min(cfg.eval.batch_size, self.num_eval_problems), shuffle=False)

        self.optimizer = make_optimizer(cfg, self.policy_model)
        if not self.eval_only:  # a disk that cannot hold one checkpoint would lose every step of the run at its end
            trainable = sum(p.numel() * p.element_size() for p in self.policy_model.parameters() if p.requires_grad)
            ckpt.check_free_space(Path(self.run_dir), 3 * trainable, "one checkpoint of this run (weights and AdamW)")
        self.scheduler = make_scheduler(cfg, self.optimizer, cfg.train.total_steps * cfg.train.epochs
                                        * cfg.train.dialog_turns_per_batch // cfg.train.optim_batch_size)
        self.grpo_step = GRPOStep(GRPOSettings.from_config(cfg), policy=self.policy_model, optimizer=self.optimizer,
                                  scheduler=self.scheduler, ref_model=ref_model,
                                  pad_token_id=self.tokenizer.pad_token_id, stop_token_ids=self.stop_ids)
        self.step = 0
        self.policy_version = 0  # optimiser steps taken: the version of the weights
        self.last_eval_step = None
        self.checkpoint_extras = dict  # a script's own state to checkpoint (sync: its prompt stream)
        self._postfix: dict = {}
        self.logger = RunLogger(self.run_dir, cfg, self.resolved_config,
                                wandb_run_id=payload.get("wandb_run_id") if payload and not self.eval_only else None)
        event = "eval_only" if self.eval_only else "resume" if payload else "start"
        self.logger.log({"step": payload["step"] if payload else 0, "event": event,
                         **{f"devices/{k}": str(v) for k, v in self.devices.as_dict().items()}})
        if payload:
            ckpt.restore_training_state(payload, model=self.policy_model, optimizer=self.optimizer,
                                        scheduler=self.scheduler)  # RNG states last of all
            counters = payload["counters"]
            self.step, self.policy_version = counters["step"], counters["policy_version"]
            self.last_eval_step = None if self.eval_only else counters["last_eval_step"]  # eval only: evaluate it here
            self.inference.push_weights(self.policy_model, self.policy_version)
        # What a crash may keep: the last step whose update finished, its RNG states, never half-updated weights
        self.completed_step, self.completed_rng = self.step, None
        self.half_updated = False  # an optimiser step ran in a GRPO step whose update has not finished
        self.optimizer.register_step_pre_hook(lambda *_: setattr(self, "half_updated", True))
        self.export_dir = None  # written when the run finishes

    def steps(self):
        bar = tqdm(range(self.step + 1, self.cfg.train.total_steps + 1), desc="GRPO", unit="step",
                   disable=not self.cfg.logging.progress_bar, dynamic_ncols=True)
        for step in bar:
            self.step = step
            with profile_to(self.run_dir, step) if step == self.cfg.logging.profile_step else contextlib.nullcontext():
                yield step
            bar.set_postfix(self._postfix)
            self.stop_flag.raise_if_set()  # at a step boundary, after that step's eval and checkpoint

    def train_on(self, rollouts) -> dict:
        """One GRPO step (grpo.step) on a batch of whole groups; returns its metrics."""
        every = self.cfg.logging.samples_every
        if every and self.step % every == 0:  # before the update: a step that fails still shows what it trained on
            self.logger.log_samples(self.step, reply_samples(rollouts, self.cfg.logging.samples_count, self.tokenizer,
                                                             self.stop_ids))
        metrics = self.grpo_step(rollouts)
        self.policy_version += metrics["optim_steps"]
        self.completed_step, self.completed_rng, self.half_updated = self.step, ckpt.rng_state(), False
        return metrics | {"policy_version": self.policy_version}

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
        if self.inference.version != self.policy_version:  # rollout workers elsewhere got the weights, it did not
            self.inference.push_weights(self.policy_model, self.policy_version)
        result = evaluate(self.eval_env, self.inference.greedy_policy, self.num_eval_problems,
                          EVAL_FIELDS[self.cfg.env.task], self.stop_ids)
        self.logger.log({"step": self.step, **result, "eval/time_s": time.perf_counter() - t0})
        shown = "".join(f" {name.removeprefix('eval/')} {result[name]:.3f}" for name in EVAL_SHOWN if name in result)
        tqdm.write(f"step {self.step}: eval accuracy {result['eval/accuracy']:.3f} "
                   f"({result['eval/num_problems']} problems){shown}, reply length {result['eval/response_length']:.0f}")
        self.last_eval_step = self.step

    def checkpoint_if_due(self, force: bool = False, rng: dict | None = None) -> None:
        """``rng``: RNG states to store instead of the current ones."""
        freq = self.cfg.train.checkpoint_frequency
        if force or (freq and self.step % freq == 0):
            path = ckpt.save_checkpoint(
                f"{self.run_dir}/{self.cfg.logging.checkpoint_dir}", self.step, model=self.policy_model,
                optimizer=self.optimizer, scheduler=self.scheduler,
                counters={"step": self.step, "policy_version": self.policy_version, "last_eval_step": self.last_eval_step},
                resolved_config=self.resolved_config,
                extra={"wandb_run_id": self.logger.wandb_run_id, **self.checkpoint_extras()},
                keep_last=self.cfg.logging.keep_last, rng=rng)
            self.last_checkpoint = (self.step, path)
            tqdm.write(f"step {self.step}: checkpoint {path}")

    @contextlib.contextmanager
    def guard(self):
        """On success: final eval, checkpoint and export (eval only: the eval alone). On SIGTERM/Ctrl-C:
        checkpoint, then exit non-zero. Either way the run ends with its summary. On any other exception:
        an emergency checkpoint of the last finished step if the weights are whole, then the exception goes on."""
        exit_code, ended = 1, None
        try:
            yield
            self.evaluate_if_due()
            if not self.eval_only:
                self.checkpoint_if_due(force=True)
                if self.cfg.logging.export:
                    self.export()
            exit_code, ended = 0, "evaluated (train.total_steps=0)" if self.eval_only else "finished"
        except StopRequested as stop:
            tqdm.write(f"stopping after step {self.step}: {stop}; writing a checkpoint")
            self.checkpoint_if_due(force=True)
            ended = f"stopped after step {self.step} ({stop})"
            raise SystemExit(stop.exit_code)
        except Exception as err:
            failed = f"step {self.step} failed ({type(err).__name__})"
            saved = self.last_checkpoint[0] if self.last_checkpoint else None
            last = self.last_checkpoint_note()
            if self.half_updated:
                note = f"{failed} inside the optimiser update: no emergency checkpoint of half-updated weights; {last}"
            elif not all(p.isfinite().all() for group in self.optimizer.param_groups for p in group["params"]):
                note = f"{failed} with non-finite weights: no emergency checkpoint; {last}"
            elif self.completed_rng is None or saved == self.completed_step:
                # a bad input's own one line says it all when there is nothing to save
                note = None if isinstance(err, UserError) else \
                    f"{failed}; no step finished since the start or the last checkpoint; {last}"
            else:
                self.step = self.completed_step  # what the checkpoint describes: counters, RNG and extras of that step
                try:
                    self.checkpoint_if_due(force=True, rng=self.completed_rng)
                    note = (f"{failed}; emergency checkpoint of step {self.step}: {self.last_checkpoint[1]} "
                            f"(resume={self.run_dir} continues from it)")
                except Exception as save_err:  # the original error matters more: report this one, raise that one
                    note = f"{failed}; so did its emergency checkpoint ({type(save_err).__name__}: {save_err}); {last}"
            if note:
                tqdm.write(note, file=sys.stderr)
            raise
        finally:
            self.inference.shutdown()
            try:
                self.logger.close(exit_code)  # writes metrics.png
            except Exception as close_err:
                if exit_code == 0:  # nothing else went wrong: this is the run's error
                    raise
                # the error that stopped the run matters more: report this one, let that one go on
                tqdm.write(f"also: closing the run's logs failed ({type(close_err).__name__}: {close_err})",
                           file=sys.stderr)
            if ended:
                print(self.summary(ended), flush=True)
            self.run_dir_claim.release()

    def last_checkpoint_note(self) -> str:
        """Where the run can be continued from, for a line saying how it ended."""
        path = self.last_checkpoint[1] if self.last_checkpoint else None
        return f"the last checkpoint is {path} (resume={self.run_dir})" if path else "this run has no checkpoint"

    def export(self) -> None:
        """``<run dir>/export``: the policy as a Hugging Face folder (a resumed run's replaces the earlier one)."""
        export_dir = Path(self.run_dir) / "export"
        shutil.rmtree(export_dir, ignore_errors=True)
        self.export_dir = export_model(self.policy_model, self.tokenizer, export_dir)
        tqdm.write(f"step {self.step}: exported the policy to {export_dir}")

    def summary(self, ended: str) -> str:
        """Where a run left its outputs, and how its held-out accuracy went: first -> best -> last eval."""
        run_dir = Path(self.run_dir)
        evals = [(row["step"], row["eval/accuracy"]) for row in read_metrics(run_dir / "metrics.jsonl")
                 if "eval/accuracy" in row]
        if evals:
            marks = {"first": evals[0], "best": max(evals, key=lambda e: e[1]), "last": evals[-1]}
            accuracy = " -> ".join(f"{mark} {acc:.3f} (step {step})" for mark, (step, acc) in marks.items())
        else:
            accuracy = "no eval ran"
        plot = run_dir / "metrics.png"
        path = self.last_checkpoint[1] if self.last_checkpoint else None  # eval only: the one evaluated, if any
        checkpoint = f"{path} (resume={path.parent.parent} continues from it)" if path else "none"
        export = (f"{self.export_dir} (transformers' from_pretrained and vllm serve load it)" if self.export_dir
                  else f"none (python -m grpo.export {path} <out> writes one)" if path else "none")
        return "\n".join([
            f"run {ended}: {run_dir}",
            f"  eval accuracy  {accuracy}",
            f"  metrics        {run_dir / 'metrics.jsonl'}" + (f", {plot}" if plot.exists() else ""),
            f"  checkpoint     {checkpoint}",
            f"  export         {export}",
        ])


def make_optimizer(cfg, model) -> torch.optim.Optimizer:
    o = cfg.optimizer
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=o.lr,
                             weight_decay=o.weight_decay, betas=tuple(o.betas), eps=o.eps)


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
