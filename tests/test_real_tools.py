"""The real Qwen2.5-Coder-0.5B-Instruct calling the sandboxed Python tool, through grpo_qwen05b_tools on CPU: its
own tool-call format (the chat template's tools block, <tool_call> JSON, </tool_call> ending the turn), the
sandbox's output as a tool turn, and sampler and trainer agreeing on the episode's sampled tokens before any
update."""

import dataclasses

import pytest
import torch

from conftest import TINY_DATA, compose
from grpo.inference.engine import TransformersInference
from grpo.inference.generation import EngineSettings
from grpo.tasks.envs import make_collector, make_env
from grpo.tasks.settings import TaskSettings
from grpo.tasks.tool_env import make_turn_env, turn_stop_ids
from grpo.training.logprobs import ReplyLogProbs, score_replies
from grpo.training.models import load_policy_model, load_reference_model, load_tokenizer, stop_token_ids
from grpo.training.replies import Replies
from grpo.training.settings import ModelSettings, OptimizerSettings
from grpo.training.step import GRPOSettings, GRPOStep, k3, loss_mask
from grpo.training.trainer import make_optimizer, make_scheduler

# one group of 4 short episodes of 2 turns: a CPU generates ~2 tokens a second a reply at 0.5B
OVERRIDES = ["allow_cpu=true", f"env.dataset={TINY_DATA}", "inference_model.max_new_tokens=64", "env.max_turns=2",
             "env.max_episode_tokens=200",
             # the config's prompt has it reason first, past what a CPU test can sample; this one has it call at once
             "env.system_prompt='Do not answer in your head: call the python tool with code that prints the result, "
             "then end with: The answer is N.'", "optimizer.warmup_steps=1", "env.repeats=4", "env.num_envs=4",
             "train.dialog_turns_per_batch=4", "train.optim_batch_size=4", "train.gradient_accumulation_steps=2",
             "train_model.compile=false", "tools.workers=2"]


@pytest.fixture(scope="module")
def real_tool_step(real_qwen_dir, one_real_model_at_a_time):
    cfg = compose("grpo_qwen05b_tools", [f"model.name={real_qwen_dir}", *OVERRIDES])
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    tok = load_tokenizer(cfg.model.name)
    models = ModelSettings.from_config(cfg)
    policy, ref = load_policy_model(models, tok, cpu), load_reference_model(models, tok, cpu)
    task = TaskSettings.from_config(cfg)
    inference = TransformersInference(EngineSettings.from_config(cfg), policy, tok, cpu,
                                      turn_stop_ids(task, tok, stop_token_ids(tok, policy.generation_config)))
    inference.turn_env = make_turn_env(task, tok)
    env = make_env(task, tok, split=task.train_split, repeats=cfg.env.repeats, num_envs=cfg.env.num_envs)
    rollouts = Replies.from_collector(next(iter(make_collector(env, inference.policy, cfg.train.dialog_turns_per_batch))))
    optim = dataclasses.replace(OptimizerSettings.from_config(cfg), total_optim_steps=1)
    optimizer = make_optimizer(optim, policy)
    step = GRPOStep(GRPOSettings.from_config(cfg), policy=ReplyLogProbs(policy), optimizer=optimizer,
                    scheduler=make_scheduler(optim, optimizer), ref_model=ref, pad_token_id=tok.pad_token_id)
    batch, stats = step.prepare(rollouts)
    # The trainer's log-probs of the episodes before any update, and their k3 KL to the sampler's over the loss's
    # tokens: the ``mismatch/kl`` the step's first minibatch logs (grpo_terms' kl_to_inference), scored without the
    # backward and optimiser step, half of this fixture's time, that nothing here checks (test_real_model does,
    # on this model; test_e2e_tools checks the step's mismatch/kl on tool episodes)
    mask = loss_mask(batch)
    trainer = score_replies(batch, step.policy, step.s)
    stats["mismatch/kl"] = float(k3(batch["behaviour_log_probs"], trainer, mask).sum() / mask.sum())
    return tok, rollouts, batch, stats


def test_qwen_calls_the_tool_in_its_own_format_and_reads_the_sandbox_s_answer(real_tool_step):
    tok, rollouts, batch, stats = real_tool_step
    close = tok.convert_tokens_to_ids("</tool_call>")
    called = [i for i, calls in enumerate(rollouts.tool_calls.tolist()) if calls]
    assert called, "the test needs episodes where the model called the tool"
    for i in called:
        tokens, sampled = rollouts.replies()[i], rollouts.sampled_masks()[i]
        first_turn_end = int((~sampled).nonzero()[0, 0])  # where the tool's turn begins
        # the model's turn ended on the closing tag, or on its end of turn (a fenced call)
        assert int(tokens[first_turn_end - 1]) in (close, tok.eos_token_id)
        tool_turn = tok.decode(tokens[first_turn_end:][~sampled[first_turn_end:]])
        assert "<tool_response>" in tool_turn
    assert stats["tools/calls_per_episode"] > 0 and stats["episode/turns"] > 1


def test_qwen_sampler_and_trainer_agree_on_the_episode_before_the_first_update(real_tool_step):
    *_, stats = real_tool_step
    assert 0 <= stats["mismatch/kl"] < 1e-3
    assert stats["kl_to_ref"] < 1e-3
