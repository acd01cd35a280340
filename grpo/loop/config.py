"""Checks on the composed config that stop a run at start with one clear message. They read the config alone and
import no torch: the scripts run them on their command line before the heavy imports (``check_command_line``)."""

from __future__ import annotations

import importlib.util
import math
import warnings

from omegaconf import OmegaConf

from grpo.process.config_keys import check_keys_and_types
from grpo.process.errors import ConfigError
from grpo.tasks.paths import check_data_path, check_model_folder
from grpo.tasks.settings import ANSWER_EXTRACTIONS, TASK_NAMES, TaskSettings, check_turn_config, parse_spec

VLLM_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# train.importance_sampling (grpo.training.importance)
IMPORTANCE_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def inference_is_cap_now(cap) -> str:
    """What a config or checkpoint of ``train.inference_is_cap=cap`` writes today."""
    return f"train.importance_sampling=token_truncate train.is_high={cap}"


TRACKERS = ("wandb", "tensorboard", "mlflow", "csv")  # logger=: each through TorchRL's logger (grpo.loop.trackers)


def validate_config(cfg) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    check_keys_and_types(cfg)

    def whole_or_null(key: str, rest: str) -> None:  # a count >= 1, or null for the default that ``rest`` names
        value = OmegaConf.select(cfg, key)
        need(value is None or type(value) is int and value >= 1, f"{key}={value!r} must be a whole number >= 1 {rest}")

    need(cfg.env.task in TASK_NAMES, f"env.task={cfg.env.task!r} is unknown; use one of {sorted(TASK_NAMES)}.")
    check_turn_config(TaskSettings.from_config(cfg))
    # counts first: the divisibility checks below would divide by them
    for key in ("env.num_envs", "train.dialog_turns_per_batch", "train.optim_batch_size",
                "train.gradient_accumulation_steps", "eval.batch_size", "eval.num_problems",
                "inference_model.max_new_tokens", "eval.max_new_tokens"):
        value = OmegaConf.select(cfg, key)
        need(isinstance(value, int) and value >= 1, f"{key}={value!r} must be a whole number >= 1.")
    # a typo such as optimizer.lr=1e-4x would otherwise end in a TypeError traceback below
    for key in ("optimizer.lr", "optimizer.warmup_steps", "optimizer.min_lr_ratio", "optimizer.weight_decay",
                "optimizer.eps", "optimizer.clip_grad_norm", "optimizer.betas.0", "optimizer.betas.1",
                "inference_model.temperature", "inference_model.top_p", "inference_model.max_model_len",
                "inference_model.gpu_memory_utilization", "train.kl_to_ref_coeff", "train.kl_to_inference_coeff",
                "train.entropy_coeff", "env.repeats", "train.total_steps", "train.epochs", "train.clip_epsilon_low",
                "train.clip_epsilon_high", "train.num_collectors", "train.buffer_size", "train.weight_update_frequency",
                "train.max_policy_lag", "train.checkpoint_frequency", "eval.frequency", "reward.success_threshold",
                "train.is_low", "train.is_high"):
        value = OmegaConf.select(cfg, key)
        need(isinstance(value, (int, float)) and not isinstance(value, bool), f"{key}={value!r} must be a number.")
    for key in ("logging.keep_last", "logging.profile_step"):
        value = OmegaConf.select(cfg, key)
        need(value is None or isinstance(value, (int, float)) and not isinstance(value, bool),
             f"{key}={value!r} must be a number or null.")
    need(isinstance(cfg.seed, int) and cfg.seed >= 0, f"seed={cfg.seed!r} must be a whole number >= 0 (numpy "
         "refuses negative seeds); e.g. seed=0.")
    o, im = cfg.optimizer, cfg.inference_model
    need(o.lr > 0, f"optimizer.lr={o.lr} must be > 0 (at 0 nothing trains); the default is 2e-6.")
    need(o.schedule in ("constant", "cosine"), f"optimizer.schedule={o.schedule!r}; use constant or cosine.")
    need(o.warmup_steps >= 0 and 0 <= o.min_lr_ratio <= 1, f"optimizer.warmup_steps={o.warmup_steps} must be >= 0 "
         f"and optimizer.min_lr_ratio={o.min_lr_ratio} in [0, 1].")
    need(o.weight_decay >= 0 and o.eps > 0 and o.clip_grad_norm > 0 and all(0 <= b < 1 for b in o.betas),
         "optimizer: weight_decay must be >= 0, eps and clip_grad_norm > 0, and both betas in [0, 1); "
         f"got weight_decay={o.weight_decay}, eps={o.eps}, clip_grad_norm={o.clip_grad_norm}, betas={list(o.betas)}.")
    need(im.temperature > 0, f"inference_model.temperature={im.temperature} must be > 0: GRPO needs sampled, "
         "different replies within a group (eval is greedy anyway); the default is 1.0.")
    need(0 < im.top_p <= 1, f"inference_model.top_p={im.top_p} must be in (0, 1] (1 = off).")
    need(isinstance(im.cache_bucket, int) and im.cache_bucket > 0, f"inference_model.cache_bucket={im.cache_bucket!r} "
         "must be a whole number of tokens > 0 (the KV cache length is rounded up to a multiple of it).")
    for key in ("train.kl_to_ref_coeff", "train.kl_to_inference_coeff", "train.entropy_coeff"):
        value = OmegaConf.select(cfg, key)
        need(value >= 0, f"{key}={value} must be >= 0 (a negative weight rewards moving away); 0 turns the term off.")
    for key in ("train_model.dtype", "ref_model.dtype", "inference_model.dtype"):
        value = OmegaConf.select(cfg, key)
        need(value in ("float32", "bfloat16", "float16"), f"{key}={value!r}; use float32, bfloat16 or float16.")
    need(cfg.train_model.gather_dtype in (None, "float32", "bfloat16"), f"train_model.gather_dtype="
         f"{cfg.train_model.gather_dtype!r}; use null, float32 or bfloat16.")
    fraction = cfg.train_model.checkpoint_fraction
    need(type(fraction) in (int, float) and 0 <= fraction <= 1, f"train_model.checkpoint_fraction={fraction!r} must be "
         "in [0, 1]: the share of decoder layers that recompute (1 = all; or train_model.gradient_checkpointing=false).")
    need(isinstance(cfg.train_model.reshard_after_forward, bool), "train_model.reshard_after_forward="
         f"{cfg.train_model.reshard_after_forward!r} must be true or false.")
    need(cfg.env.repeats >= 2, f"env.repeats={cfg.env.repeats}: GRPO compares replies within a group, so it needs "
         "at least 2 replies per prompt; set env.repeats=4 (or more).")
    need(cfg.env.num_envs % cfg.env.repeats == 0, f"env.num_envs={cfg.env.num_envs} must be a multiple of "
         f"env.repeats={cfg.env.repeats} (whole groups are generated together); e.g. env.num_envs={4 * cfg.env.repeats}.")
    t = cfg.train
    need(t.dialog_turns_per_batch % cfg.env.num_envs == 0 or (t.dynamic_sampling is True and
                                                              cfg.env.num_envs > t.dialog_turns_per_batch),
         f"train.dialog_turns_per_batch={t.dialog_turns_per_batch} must be a multiple of env.num_envs="
         f"{cfg.env.num_envs} (or smaller than it with train.dynamic_sampling=true: each step then generates "
         "env.num_envs replies and trains on the informative groups among them).")
    need(t.dialog_turns_per_batch % t.optim_batch_size == 0, f"train.optim_batch_size={t.optim_batch_size} must divide "
         f"train.dialog_turns_per_batch={t.dialog_turns_per_batch}.")
    need(t.optim_batch_size % t.gradient_accumulation_steps == 0, f"train.gradient_accumulation_steps="
         f"{t.gradient_accumulation_steps} must divide train.optim_batch_size={t.optim_batch_size}.")
    whole_or_null("train.micro_batch_tokens", "(e.g. 16384) or null.")
    whole_or_null("ref_model.micro_batch_tokens", "(e.g. 131072) or null (training's micro-batches).")
    need(type(t.total_steps) is int and t.total_steps >= 0, f"train.total_steps={t.total_steps!r} must be a whole "
         "number >= 0 (0 = evaluate only: model.name, or resume='s checkpoint).")
    minutes = t.max_minutes
    need(minutes is None or type(minutes) in (int, float) and minutes > 0, f"train.max_minutes={minutes!r} must be a "
         "number of minutes > 0 (e.g. 15), or null to run train.total_steps.")
    need(isinstance(cfg.resume_allow_changes, bool), f"resume_allow_changes={cfg.resume_allow_changes!r} must be true or "
         "false.")
    need(cfg.ray.address is None or cfg.ray.num_cpus is None, f"ray.num_cpus={cfg.ray.num_cpus} sizes a local Ray, but "
         f"ray.address={cfg.ray.address} joins a cluster, whose nodes declare their own CPUs. Fix: ray.num_cpus=null")
    need(isinstance(cfg.ray.kill_on_low_memory, bool), f"ray.kill_on_low_memory={cfg.ray.kill_on_low_memory!r} must be "
         "true or false.")
    need(isinstance(cfg.logging.export, bool), f"logging.export={cfg.logging.export!r} must be true or false.")
    need(t.epochs >= 1, f"train.epochs={t.epochs} must be >= 1.")
    need(0 <= t.clip_epsilon_low < 1 and t.clip_epsilon_high >= 0, "train.clip_epsilon_low must be in [0, 1) and "
         "train.clip_epsilon_high >= 0 (e.g. 0.2 and 0.28).")
    need(t.inference_is_cap is None, "train.inference_is_cap is retired: write "
         f"{inference_is_cap_now(t.inference_is_cap)} instead (the same truncated importance sampling).")
    need(t.importance_sampling in IMPORTANCE_MODES, f"train.importance_sampling={t.importance_sampling!r}; use one of "
         f"{', '.join(IMPORTANCE_MODES)}.")
    need(0 <= t.is_low <= 1 <= t.is_high, f"train.is_low={t.is_low} and train.is_high={t.is_high} must bound the "
         "importance weights around 1: 0 <= is_low <= 1 <= is_high (e.g. 0.5 and 2).")
    need(t.on_nonfinite in ("stop", "skip"), f"train.on_nonfinite={t.on_nonfinite!r}; use stop (end the run before a "
         "NaN/inf gradient reaches the weights) or skip (skip that optimiser step and go on).")
    need(t.aggregation in ("token_mean", "prompt_mean"), f"train.aggregation={t.aggregation!r}; use token_mean or prompt_mean.")
    need(t.loss_variant in ("grpo", "dr_grpo", "gspo"), f"train.loss_variant={t.loss_variant!r}; use grpo, dr_grpo or gspo.")
    for key in ("train.dynamic_sampling", "train.overlong_filter", "train.packed_sequences", "inference_model.compact_rows",
                "inference_model.continuous_turns", "inference_model.compile_prefill", "ref_model.score_early"):
        need(isinstance(OmegaConf.select(cfg, key), bool), f"{key}={OmegaConf.select(cfg, key)!r} must be true or false.")
    need(type(t.max_extra_generation_batches) is int and t.max_extra_generation_batches >= 0,
         f"train.max_extra_generation_batches={t.max_extra_generation_batches!r} must be a whole number >= 0 (extra "
         "generation batches dynamic sampling may draw in a step).")
    buffer, penalty = cfg.reward.overlong_buffer, cfg.reward.overlong_penalty
    need(type(buffer) is int and 0 <= buffer <= im.max_new_tokens, f"reward.overlong_buffer={buffer!r} must be a whole "
         f"number of tokens in [0, inference_model.max_new_tokens={im.max_new_tokens}] (0 = no overlong penalty).")
    need(isinstance(penalty, (int, float)) and not isinstance(penalty, bool) and math.isfinite(penalty) and penalty >= 0,
         f"reward.overlong_penalty={penalty!r} must be a number >= 0 (the reward lost at max_new_tokens).")
    timeout = cfg.reward.timeout_s
    need(isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0, f"reward.timeout_s="
         f"{timeout!r} must be a number of seconds > 0 (how long one call of a reward function may take).")
    need(cfg.inference_model.backend in ("transformers", "vllm"), f"inference_model.backend="
         f"{cfg.inference_model.backend!r}; use transformers or vllm.")
    need(im.vllm_log_level in VLLM_LOG_LEVELS, f"inference_model.vllm_log_level={im.vllm_log_level!r}; use one of "
         f"{', '.join(VLLM_LOG_LEVELS)}.")
    names = [cfg.logger] if isinstance(cfg.logger, str) else list(cfg.logger) if OmegaConf.is_list(cfg.logger) else [None]
    need(all(name in (*TRACKERS, "none") for name in names) and len(set(names)) == len(names), f"logger={cfg.logger!r}; "
         f"use one of {', '.join(TRACKERS)} or none, or a list of them (logger=[tensorboard,csv]).")
    for name in sorted(set(TRACKERS) & set(names) - {"csv"}):  # wandb is a dependency, the others an extra
        need(importlib.util.find_spec(name) is not None, f"logger={name} needs the {name} package, which is not "
             "installed; " + ("pip install wandb, or logger=csv or none." if name == "wandb" else
                              "pip install -e '.[loggers]' (tensorboard, mlflow-skinny)."))
    need(t.num_collectors >= 1, f"train.num_collectors={t.num_collectors} must be >= 1.")
    need(t.buffer_size >= 0, f"train.buffer_size={t.buffer_size} must be >= 0 (batches the async FIFO holds "
         "beyond one a worker).")
    need(t.weight_update_frequency >= 1, f"train.weight_update_frequency={t.weight_update_frequency} must be >= 1.")
    need(type(t.max_worker_restarts) is int and t.max_worker_restarts >= 0, f"train.max_worker_restarts="
         f"{t.max_worker_restarts!r} must be a whole number >= 0 (0 = a failed rollout worker stops the run).")
    need(t.max_policy_lag >= t.weight_update_frequency - 1, f"train.max_policy_lag={t.max_policy_lag} is below "
         f"train.weight_update_frequency - 1 = {t.weight_update_frequency - 1}: every async batch would be too stale; "
         f"raise train.max_policy_lag to at least {t.weight_update_frequency - 1}.")
    tm = cfg.train_model
    # Measured on an H100, SmolLM2-135M, IFEval prompts, 40 steps: a bf16-autocast trainer scoring a
    # float32 sampler's replies drifted (sampler/trainer KL before each update 8.5e-4 at step 1, 1 to
    # 200 from step 9, clip fraction 0.4); all float32 stayed at 3.5e-11, bf16 sampler + autocast at 2e-3.
    need(not (tm.mixed_precision and tm.dtype == "float32" and im.dtype == "float32"),
         "train_model.mixed_precision=true computes the loss in bfloat16 while inference_model.dtype=float32 samples "
         "in float32, and the two drift apart as training goes on; set train_model.mixed_precision=false (all "
         "float32) or inference_model.dtype=bfloat16.")
    need(isinstance(im.top_k, int) and im.top_k >= 0, f"inference_model.top_k={im.top_k!r} must be a whole number "
         ">= 0 (0 = off: sample from the whole vocabulary).")
    need(im.backend != "vllm" or im.temperature == 1 or not im.top_k and im.top_p >= 1, "inference_model.backend=vllm "
         f"with top_k={im.top_k}, top_p={im.top_p} and temperature={im.temperature}: vLLM reports log-probs after both "
         "or before both, and the trainer scores them after temperature, before the cut; set "
         "inference_model.temperature=1.0, or top_k=0 and top_p=1.0, or backend=transformers.")
    need(cfg.reward.answer_extraction in ANSWER_EXTRACTIONS, f"reward.answer_extraction="
         f"{cfg.reward.answer_extraction!r}; use flexible (an explicit final answer, else the last number), strict (an "
         "explicit final answer only) or tag (inside <answer> only).")
    functions, weights = cfg.reward.functions, cfg.reward.weights  # imported and checked against the data at load
    need(OmegaConf.is_list(functions) and all(isinstance(f, str) for f in functions), f"reward.functions={functions!r} "
         "must be a list of module.path:function or path/to/file.py:function, e.g. "
         "reward.functions=[my_pkg.rewards:score].")
    need(OmegaConf.is_list(weights) and all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                                            for w in weights), f"reward.weights={weights!r} must be a list of numbers.")
    for i, spec in enumerate(functions):
        parse_spec(spec, i)
    need(len(weights) in (0, len(functions)), f"reward.weights has {len(weights)} entries for {len(functions)} "
         "reward.functions; give one weight per function, or none (1.0 each).")
    need(cfg.env.task != "generic" or len(functions) > 0, "env.task=generic is scored by your reward functions alone, "
         "and reward.functions is empty; set reward.functions=[my_pkg.rewards:score] (README, \"Your own task\").")
    need(isinstance(cfg.env.prompt_key, str) and cfg.env.prompt_key != "", f"env.prompt_key={cfg.env.prompt_key!r} "
         "must be a column name (the column holding each prompt).")
    need(cfg.env.answer_key is None or isinstance(cfg.env.answer_key, str) and cfg.env.answer_key != "",
         f"env.answer_key={cfg.env.answer_key!r} must be a column name or null.")
    for key, value in (("inference_model.max_new_tokens", im.max_new_tokens), ("eval.max_new_tokens", cfg.eval.max_new_tokens)):
        need(value < im.max_model_len, f"{key}={value} leaves no room for the prompt in inference_model.max_model_len="
             f"{im.max_model_len} (the context both engines are sized for); raise "
             f"inference_model.max_model_len to at least {value} plus the longest prompt.")
    need(cfg.eval.frequency >= 0, f"eval.frequency={cfg.eval.frequency} must be >= 0 (0 = only before and after).")
    k, temperature = cfg.eval.samples_per_problem, cfg.eval.temperature
    need(type(k) is int and k >= 0, f"eval.samples_per_problem={k!r} must be a whole number >= 0 (replies sampled a "
         "problem for eval/pass@k; 0 or 1 = off).")
    need(isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 0,
         f"eval.temperature={temperature!r} must be a number > 0 (the sampled eval's temperature).")
    need(t.checkpoint_frequency >= 0, f"train.checkpoint_frequency={t.checkpoint_frequency} must be >= 0 (0 = only "
         "at the end).")
    need(cfg.logging.keep_last is None or cfg.logging.keep_last >= 0, f"logging.keep_last={cfg.logging.keep_last} "
         "must be >= 0 (0 or null: keep every checkpoint).")
    lg = cfg.logging
    need(type(lg.samples_every) is int and lg.samples_every >= 0, f"logging.samples_every={lg.samples_every!r} must "
         "be a whole number of steps >= 0 (0 = never show replies).")
    need(type(lg.samples_count) is int and lg.samples_count >= 1, f"logging.samples_count={lg.samples_count!r} must "
         "be a whole number of prompts >= 1.")
    need(0 < im.gpu_memory_utilization <= 1, f"inference_model.gpu_memory_utilization={im.gpu_memory_utilization} "
         "must be in (0, 1] (vLLM's share of its device's memory).")
    check_model_folder(cfg.model.name)  # local paths: here, before the scripts' imports, not 9 s into the run
    check_data_path(cfg.env.dataset, cfg.env.train_split)


def warn_if_too_few_rows(cfg, train_rows: int) -> None:
    """Legal but degenerate: a train split smaller than one step's prompts repeats prompts within every step."""
    prompts_per_step = cfg.train.dialog_turns_per_batch // cfg.env.repeats
    if train_rows < prompts_per_step:
        warnings.warn(f"env.dataset={cfg.env.dataset!r} split {cfg.env.train_split!r} has {train_rows} row(s), fewer "
                      f"than the {prompts_per_step} prompts a step draws (train.dialog_turns_per_batch / env.repeats): "
                      "every step trains on the same prompts, several times over.")
