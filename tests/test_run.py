"""grpo/run.py: the state both scripts share, driven as the async script drives it."""

import pytest

from conftest import compose_in_run_dir
from grpo.envs import make_collector, make_env
from grpo.run import TrainingRun


@pytest.fixture
def async_run(tmp_path, tiny_model_dir, tiny_data_dir):
    """A TrainingRun as grpo-async.py builds it (dedicated inference: its own engine only evaluates),
    with the vLLM backend, so that engine holds a copy of the weights rather than the policy itself."""
    pytest.importorskip("vllm")
    cfg = compose_in_run_dir(tmp_path, [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}", "logger=none",
                                "logging.progress_bar=false", "inference_model.backend=vllm", "env.repeats=4",
                                "env.num_envs=8", "train.dialog_turns_per_batch=8", "train.optim_batch_size=4",
                                "train.gradient_accumulation_steps=1", "train.epochs=1", "eval.num_problems=8", "eval.batch_size=8"])
    run = TrainingRun(cfg, inference_engines=1, dedicated_inference=True)
    yield run
    run.inference.shutdown()
    run.logger.close()


def test_policy_version_counts_optimiser_steps_and_eval_sees_them(async_run):
    run = async_run
    env = make_env(run.cfg, run.tokenizer, split="train", repeats=4, num_envs=8)
    rollouts = next(iter(make_collector(env, run.inference.policy, 8))).reshape(-1)
    metrics = run.train_on(rollouts)
    # 8 replies in minibatches of 4, one epoch: two optimiser steps, whatever the script
    assert metrics["optim_steps"] == 2 and run.policy_version == metrics["policy_version"] == 2
    # the engine that evaluates got no push from the training loop (the workers did): eval pushes first
    assert run.inference.version == 0
    run.evaluate_if_due(force=True)
    assert run.inference.version == run.policy_version == 2
