"""grpo/tasks/envs.py: the one-turn collector (the tasks' envs and rewards: test_rewards.py, test_ifeval.py,
test_user_task.py)."""

import warnings

import torch
from tensordict import TensorDict
from torchrl.collectors.llm import LLMCollector
from torchrl.envs import RenameTransform

from conftest import compose
from grpo.inference.decoding import ReplySampler
from grpo.inference.engine import make_transformers_policy
from grpo.inference.generation import EngineSettings, generate_kwargs
from grpo.tasks.paths import resolve_local_paths
from grpo.tasks.data import serve_from
from grpo.tasks.envs import OneTurnCollector, inverts_nothing, make_collector, make_env
from grpo.tasks.settings import TaskSettings
from grpo.training.models import load_causal_lm, load_tokenizer, stop_token_ids
from grpo.training.replies import TENSORS, Replies


def torchrl_collector(env, policy, replies: int) -> LLMCollector:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return LLMCollector(env, policy=policy, dialog_turns_per_batch=replies, total_dialog_turns=-1)


def tiny_sampling(model_dir, data_dir):
    """The tiny task's config (groups of 4, batches of 8, 16 new tokens), tokenizer, model and sampling options."""
    cfg = compose("grpo_tiny", [f"model.name={model_dir}", f"env.dataset={data_dir}", "env.repeats=4",
                                "env.num_envs=8", "inference_model.max_new_tokens=16"])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    model = load_causal_lm(cfg.model.name, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
    options = generate_kwargs(EngineSettings.from_config(cfg), tok, greedy=False, max_new_tokens=16,
                              stop_ids=stop_token_ids(tok, model.generation_config))
    return cfg, tok, model, options


def test_one_turn_collector_yields_what_torchrl_s_collector_yields(tiny_model_dir, tiny_data_dir):
    """Served from the same prompt batch, with the same sampling seed, two collections in a row of two env batches
    each hold the same prompts, replies, log-probs, rewards and rows, in the same order, as TorchRL's
    ``LLMCollector`` gives: ours only skips what a one-turn env does not need (the next observation of envs that
    are all done, a copy of every step, and a scan for private keys no env writes)."""
    cfg, tok, model, options = tiny_sampling(tiny_model_dir, tiny_data_dir)
    collected = {}
    for build in (torchrl_collector, make_collector):
        env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=4, num_envs=8)
        sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
        collector = build(env, make_transformers_policy(sampler, tok, gen_kwargs=options), 16)
        serve_from(env, collector, 3)
        batches = iter(collector)
        collected[type(collector)] = []
        for _ in range(2):
            torch.manual_seed(0)
            batch = next(batches)
            # no private ("_...") key: ours skips TorchRL's scan that would drop them
            assert not [key for key in batch.keys(True) if any(part.startswith("_") for part in
                                                                (key if isinstance(key, tuple) else (key,)))]
            collected[type(collector)].append(Replies.from_collector(batch))
    assert collected.keys() == {LLMCollector, OneTurnCollector}
    theirs, ours = collected[LLMCollector], collected[OneTurnCollector]
    assert theirs[0].row_index.tolist() != theirs[1].row_index.tolist()  # two different prompt batches
    for expected, got in zip(theirs, ours):
        assert len(got.user_prompts) == 16 and got.user_prompts == expected.user_prompts
        for name in TENSORS:
            assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_prompt_tokens_are_each_group_s_chat_template_tokenized_once(tiny_model_dir, tiny_data_dir):
    """A reset gives every reply its prompt's tokens (the chat template with the generation prompt, as TorchRL's
    wrapper tokenizes a history), rendering each distinct prompt once; the policy, taking them, generates what it
    generates from the history alone."""
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}"])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=4, num_envs=8)
    renders, render = [], tok.apply_chat_template
    tok.apply_chat_template = lambda conversation, **kw: renders.append(conversation) or render(conversation, **kw)
    try:
        reset = env.reset()
    finally:
        del tok.apply_chat_template
    history = reset["history", "prompt"]
    assert len(renders) == 2 and renders[0] != renders[1]  # 8 replies: 2 prompts x 4
    expected = history.apply_chat_template(tokenizer=tok, add_generation_prompt=True, tokenize=True, padding=False,
                                           return_dict=True).get("input_ids", as_list=True)
    tokens = reset["tokens", "prompt"]
    assert [row[row != tok.pad_token_id].tolist() for row in tokens] == [row.tolist() for row in expected]

    model = load_causal_lm(cfg.model.name, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
    policy = make_transformers_policy(ReplySampler(model, compile=False, cache_bucket=64, compact_rows=False), tok,
                                      gen_kwargs=generate_kwargs(EngineSettings.from_config(cfg), tok, greedy=False,
                                                                 max_new_tokens=16,
                                                                 stop_ids=stop_token_ids(tok, model.generation_config)))
    outs = []
    for given in (reset, reset.exclude("tokens")):
        torch.manual_seed(0)
        outs.append(policy(given.copy()))
    with_tokens, from_history = outs
    for out in outs:  # the prompt the policy generated from: the env's tokens, or the history rendered
        assert [p.tolist() for p in out.get(("tokens", "prompt"), as_list=True)] == [p.tolist() for p in expected]
    assert with_tokens["text", "response"] == from_history["text", "response"]
    for key in (("tokens", "full"), ("log_probs", "response")):
        assert all(torch.equal(a, b) for a, b in zip(with_tokens.get(key, as_list=True),
                                                      from_history.get(key, as_list=True))), key


def test_a_step_passes_its_input_on_as_it_is_while_no_transform_inverts(tiny_model_dir, tiny_data_dir):
    """TorchRL's Transform.inv copies a step's input before the transforms invert it; none of a task env's does,
    so the copy is skipped: the same collection, key for key and reply for reply, as with TorchRL's own inverse.
    A transform that does invert gets the copy back."""
    cfg, tok, model, options = tiny_sampling(tiny_model_dir, tiny_data_dir)
    collected = {}
    for torchrl_inverse in (True, False):
        env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=4, num_envs=8)
        assert all(inverts_nothing(t) for t in env.transform)
        if torchrl_inverse:
            del env.transform.inv  # TorchRL's own, which copies
        policy = make_transformers_policy(ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True), tok,
                                          gen_kwargs=options)
        collector = make_collector(env, policy, 8)
        serve_from(env, collector, 3)
        torch.manual_seed(0)
        batch = next(iter(collector))
        collected[torchrl_inverse] = (sorted(map(str, batch.keys(True, True))), Replies.from_collector(batch))
    (keys_torchrl, theirs), (keys_ours, ours) = collected[True], collected[False]
    assert keys_ours == keys_torchrl
    assert ours.user_prompts == theirs.user_prompts
    for name in TENSORS:
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=4, num_envs=8)
    env.append_transform(RenameTransform(in_keys=[], out_keys=[], in_keys_inv=["action"], out_keys_inv=["move"]))
    assert not inverts_nothing(env.transform[-1])
    step_input = TensorDict({"move": torch.ones(2)}, batch_size=[2])
    inverted = env.transform.inv(step_input)
    assert inverted is not step_input and "action" in inverted.keys()  # TorchRL's inverse again, copy and all
