"""grpo/inference/reply_policy.py: the replies, tokens, log-probs and chat histories TorchRL's own wrapper wrote
around the same sampler, from one decode a reply."""

import pytest
import torch
from tensordict import TensorDict
from torchrl.data.llm import History
from torchrl.modules.llm.policies.common import ChatHistory

from conftest import compose
from grpo.inference.decoding import ReplySampler
from grpo.inference.engine import make_transformers_policy
from grpo.inference.generation import EngineSettings, generate_kwargs
from grpo.process.setup import resolve_local_paths
from grpo.tasks.envs import make_env
from grpo.training.models import load_causal_lm, load_tokenizer, stop_token_ids
from torchrl_wrapper import torchrl_history_policy


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tiny_data_dir):
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}"])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    model = load_causal_lm(cfg.model.name, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
    stop_ids = stop_token_ids(tok, model.generation_config)
    options = generate_kwargs(EngineSettings.from_config(cfg), tok, greedy=False, max_new_tokens=16, stop_ids=stop_ids)
    sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
    return cfg, tok, sampler, options


def test_the_policy_writes_what_torchrl_s_wrapper_wrote_and_the_env_scores_it_the_same(tiny):
    cfg, tok, sampler, options = tiny
    env = make_env(cfg, tok, split="train", repeats=4, num_envs=16, shuffle=False)
    reset = env.reset()
    outs, steps = [], []
    for policy in (make_transformers_policy(sampler, tok, gen_kwargs=options),
                   torchrl_history_policy(sampler, tok, options)):
        torch.manual_seed(0)
        outs.append(policy(reset.copy()))
        steps.append(env.step(outs[-1].copy()))
    ours, theirs = outs
    replies = ours.get(("tokens", "response"), as_list=True)
    ended = [bool(r.numel()) and int(r[-1]) in options["eos_token_id"] for r in replies]
    assert any(ended) and not all(ended), "the test needs replies that stopped and replies cut at the cap"
    for key in (("tokens", "prompt"), ("tokens", "response"), ("tokens", "full"), ("log_probs", "response")):
        assert all(torch.equal(a, b) for a, b in zip(ours.get(key, as_list=True), theirs.get(key, as_list=True),
                                                     strict=True)), key
    assert ours["text", "response"] == theirs["text", "response"]
    for part in ("prompt", "response", "full"):
        a, b = ours["history", part], theirs["history", part]
        assert a.batch_size == b.batch_size and a.role == b.role and a.content == b.content, part
    assert ours["history", "response"].is_complete == [[done] for done in ended]
    for key in ("reward", "success"):
        assert torch.equal(steps[0]["next", key], steps[1]["next", key])
    next_prompts = [step["next", "history", "prompt"] for step in steps]  # the next turn's prompt: prompt + reply
    assert next_prompts[0].content == next_prompts[1].content


def test_prompts_without_tokens_are_rendered_by_the_chat_template(tiny):
    cfg, tok, sampler, options = tiny
    chats = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "And 7 - 4?"}]]
    given = TensorDict(history=ChatHistory(prompt=History.from_chats(chats)), batch_size=(2,))
    out = make_transformers_policy(sampler, tok, gen_kwargs=options)(given)
    rendered = [tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                for chat in chats]
    assert [p.tolist() for p in out.get(("tokens", "prompt"), as_list=True)] == [list(r) for r in rendered]
    assert [m[-1] for m in out["history", "full"].role] == ["assistant", "assistant"]


def test_a_batch_of_other_than_one_dimension_is_refused(tiny):
    cfg, tok, sampler, options = tiny
    env = make_env(cfg, tok, split="train", repeats=2, num_envs=4, shuffle=False)
    with pytest.raises(ValueError, match="one batch dimension"):
        make_transformers_policy(sampler, tok, gen_kwargs=options)(env.reset().reshape(2, 2))
