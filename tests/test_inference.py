"""grpo/inference.py: generation on the training model object itself stays correct while it trains."""

import torch

from conftest import compose
from grpo.envs import make_env
from grpo.inference import TransformersInference
from grpo.models import load_policy_model, load_tokenizer
from grpo.setup import resolve_local_paths
from grpo.trainer import train_mode_if


def greedy_replies(inference, cfg, tok) -> list[list[int]]:
    env = make_env(cfg, tok, split="test", repeats=1, num_envs=8, shuffle=False)
    td = inference.greedy_policy(env.reset())
    return [s["tokens", "response"].tolist() for s in td.unbind(0)]


def test_generation_with_gradient_checkpointing_on_matches_generation_without(tiny_model_dir, tiny_data_dir):
    """A one-GPU run (and every CPU run) generates with the trained model object. With gradient
    checkpointing on, that model used to sit in train mode, where transformers drops generate()'s
    KV cache: the default job crashed on a GPU, and on CPU grpo_tiny's greedy accuracy fell to 0."""
    replies = {}
    for checkpointing in (False, True):
        cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}",
                                    f"train_model.gradient_checkpointing={checkpointing}"])
        resolve_local_paths(cfg)
        tok = load_tokenizer(cfg.model.name)
        model = load_policy_model(cfg, tok, torch.device("cpu"))
        inference = TransformersInference(cfg, model, tok, torch.device("cpu"))
        assert inference.model is model
        with train_mode_if(model, checkpointing):  # what optimisation does between two collections
            assert model.training is checkpointing
        assert not model.training
        replies[checkpointing] = greedy_replies(inference, cfg, tok)
    assert replies[True] == replies[False]
    assert any(tok.eos_token_id in r for r in replies[True])
