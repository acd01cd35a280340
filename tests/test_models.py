"""grpo/models.py: generation options, the static-cache generation path, attention kernels."""

import pytest
import torch

from conftest import compose
from grpo.envs import make_collector, make_env
from grpo.models import (compiled_decode_kwargs, configure_attention_kernels, generate_kwargs, load_causal_lm,
                         load_tokenizer, make_transformers_policy, reply_log_probs)
from grpo.rollouts import to_training_batch
from grpo.setup import resolve_local_paths


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tiny_data_dir):
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}", "env.repeats=4",
                                "env.num_envs=8", "inference_model.max_new_tokens=16"])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    model = load_causal_lm(cfg.model.name, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
    return cfg, tok, model


def collect(cfg, tok, model, gen_kwargs: dict, seed: int = 0):
    torch.manual_seed(seed)
    env = make_env(cfg, tok, split="train", repeats=4, num_envs=8, shuffle=False)
    policy = make_transformers_policy(model, tok, gen_kwargs=gen_kwargs)
    return next(iter(make_collector(env, policy, 8))).reshape(-1), policy


def test_compiled_decode_is_off_on_cpu_and_when_disabled(tiny):
    cfg, _, model = tiny
    assert cfg.inference_model.compile  # the default: on, where a GPU makes it possible
    assert compiled_decode_kwargs(cfg, model) == {}  # transformers compiles nothing on CPU
    cfg.inference_model.compile = False
    try:
        assert compiled_decode_kwargs(cfg, model) == {}
    finally:
        cfg.inference_model.compile = True


def test_static_cache_reaches_generate_and_keeps_log_probs_exact(tiny):
    """TorchRL's wrapper drops generate() options it does not know; ours passes them on. With the
    static KV cache (what the compiled decode step runs on), replies still come with the log-probs
    of the model that sampled them, and greedy replies are those of the default cache."""
    cfg, tok, model = tiny
    static = {"cache_implementation": "static", "max_cache_len": 384}
    greedy = generate_kwargs(cfg, tok, greedy=True, max_new_tokens=16)
    if hasattr(model, "_previous_max_cache_length"):
        del model._previous_max_cache_length
    rollouts, policy = collect(cfg, tok, model, {**greedy, **static})
    assert policy.generate_kwargs["cache_implementation"] == "static"
    assert model._previous_max_cache_length == 384  # set by transformers when it builds a static cache

    baseline, _ = collect(cfg, tok, model, greedy)
    for a, b in zip(rollouts.unbind(0), baseline.unbind(0)):
        assert torch.equal(a["tokens", "response"], b["tokens", "response"])

    sampled, _ = collect(cfg, tok, model, {**generate_kwargs(cfg, tok, greedy=False, max_new_tokens=16), **static})
    batch = to_training_batch(sampled, pad_token_id=tok.pad_token_id)
    assert batch["reply_mask"].sum() > 0
    with torch.no_grad():
        trainer_lp, _ = reply_log_probs(model, batch, with_entropy=False)
    mask = batch["reply_mask"]
    torch.testing.assert_close(batch["behaviour_log_probs"][mask], trainer_lp[mask], atol=1e-4, rtol=1e-4)


def test_cudnn_attention_follows_the_config(tiny):
    cfg, _, _ = tiny
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        configure_attention_kernels(cfg)
        assert not torch.backends.cuda.cudnn_sdp_enabled()  # off by default
        cfg.model.cudnn_attention = True
        configure_attention_kernels(cfg)
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        cfg.model.cudnn_attention = False
        torch.backends.cuda.enable_cudnn_sdp(before)
