"""Real models through the training step, on CPU: SmolLM2-135M-Instruct on IFEval-format prompts, and
Qwen2.5-Coder-0.5B-Instruct (152k vocabulary) through the default GSM8K recipe's config (grpo_qwen05b)
on short arithmetic questions; both give short replies that end at eos (their real GSM8K replies run
past any cap a CPU test can afford).

Their tokenizers end turns with <|im_end|>; SmolLM2's pads with it too and its generation_config pads
with eos: the case that once filled replies with runs of eos counted as reply tokens (kl_to_inference
1241 at step 1 on a GPU). Here a handful of replies go through the same code the scripts run.
"""

import dataclasses

import pytest
import torch

from conftest import TINY_DATA, compose
from grpo.inference.engine import TransformersInference
from grpo.inference.generation import EngineSettings
from grpo.tasks.envs import make_collector, make_env
from grpo.tasks.settings import TaskSettings
from grpo.training.logprobs import ReplyLogProbs
from grpo.training.models import load_policy_model, load_reference_model, load_tokenizer, stop_token_ids
from grpo.training.replies import Replies
from grpo.training.settings import ModelSettings, OptimizerSettings
from grpo.training.step import GRPOSettings, GRPOStep
from grpo.training.trainer import make_optimizer, make_scheduler

# the reply cap: Qwen's replies to these prompts end by 7 tokens (one of 8 runs on): 24 halves its sampling time
MAX_NEW_TOKENS = {"smollm2-135m": 48, "qwen2.5-coder-0.5b": 24}
ONE_STEP = ["optimizer.warmup_steps=1", "env.repeats=4",
            "env.num_envs=8", "train.dialog_turns_per_batch=8", "train.optim_batch_size=8"]
SETUPS = {  # model -> (its folder's fixture, config, overrides)
    "smollm2-135m": ("real_model_dir", "grpo_ifeval_tiny", []),
    # two micro-batches of 4: one of 8 with full logits was killed at 24 GB; four of 2 faulted in 2 GB more (each
    # backward's dense embedding and LM-head gradients), ~10 s of this fixture on CI's VM, at a higher peak
    "qwen2.5-coder-0.5b": ("real_qwen_dir", "grpo_qwen05b", [
        "allow_cpu=true", f"env.dataset={TINY_DATA}", "train.gradient_accumulation_steps=2",
        "train_model.compile=false",  # compiling 24 layers on CPU (~38 s) would be most of this test; test_step checks it
        "env.system_prompt='Answer with the final number only, as: The answer is N.'"]),
}


@pytest.fixture(scope="module", params=sorted(SETUPS))
def real_step(request, one_real_model_at_a_time):
    model_fixture, config, overrides = SETUPS[request.param]
    cfg = compose(config, [f"model.name={request.getfixturevalue(model_fixture)}", *ONE_STEP, *overrides,
                           f"inference_model.max_new_tokens={MAX_NEW_TOKENS[request.param]}"])
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    tok = load_tokenizer(cfg.model.name)
    models = ModelSettings.from_config(cfg)
    policy = load_policy_model(models, tok, cpu)
    ref = load_reference_model(models, tok, cpu)
    stop_ids = stop_token_ids(tok, policy.generation_config)
    inference = TransformersInference(EngineSettings.from_config(cfg), policy, tok, cpu, stop_ids)
    env = make_env(TaskSettings.from_config(cfg), tok, split=cfg.env.train_split, repeats=cfg.env.repeats,
                   num_envs=cfg.env.num_envs)
    rollouts = Replies.from_collector(next(iter(make_collector(env, inference.policy,
                                                               cfg.train.dialog_turns_per_batch))))
    # the frozen reference is the starting policy, weight for weight: what the step must move the policy away from
    # (compared with it after the step, not with a copy: a copy of Qwen's weights is 2 GB more memory to fault in,
    # several seconds of this fixture on CI's VM)
    before = dict(ref.named_parameters())
    assert before.keys() == dict(policy.named_parameters()).keys()
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())
    optim = dataclasses.replace(OptimizerSettings.from_config(cfg), total_optim_steps=1)
    optimizer = make_optimizer(optim, policy)
    step = GRPOStep(GRPOSettings.from_config(cfg), policy=ReplyLogProbs(policy), optimizer=optimizer,
                    scheduler=make_scheduler(optim, optimizer), ref_model=ref, pad_token_id=tok.pad_token_id)
    batch, stats = step.prepare(rollouts)
    stats |= step.optimize(batch)
    return tok, rollouts, batch, stats, before, policy


def test_real_tokenizer_pads_apart_from_eos(real_step):
    tok, *_ = real_step
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id


def test_real_replies_end_at_eos_and_nothing_after_it_is_a_reply_token(real_step, request):
    tok, rollouts, batch, stats, *_ = real_step
    replies = rollouts.replies()
    finished = [r for r in replies if r.numel() < MAX_NEW_TOKENS[request.node.callspec.params["real_step"]]]
    assert len(finished) >= len(replies) // 2, "most replies to one-sentence prompts end before the cap"
    for r in finished:
        assert int(r[-1]) == tok.eos_token_id and tok.eos_token_id not in r[:-1].tolist()
    assert batch["reply_length"].tolist() == [r.numel() for r in replies]
    assert stats["response_length"] == pytest.approx(sum(r.numel() for r in replies) / len(replies))
    assert stats["response_truncated_fraction"] == pytest.approx(1 - len(finished) / len(replies))


def test_real_sampler_and_trainer_agree_before_the_first_update(real_step):
    *_, stats, _, _ = real_step
    assert 0 <= stats["mismatch/kl"] < 1e-3
    assert stats["kl_to_ref"] < 1e-3  # the reference is the same weights before any update


def test_real_one_optimiser_step_changes_the_weights(real_step):
    *_, stats, before, policy = real_step
    assert stats["optim_steps"] == 1 and stats["grad_norm"] > 0
    moved = [float((p.detach() != before[n]).float().mean()) for n, p in policy.named_parameters()]
    assert min(moved) > 0 and sum(moved) / len(moved) > 0.9
