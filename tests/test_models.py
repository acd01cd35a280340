"""grpo/training/models.py: loading, attention kernels, CPU threads, the ids that end a reply (a bad model folder: test_bad_inputs.py)."""

import pytest
import torch

from conftest import compose
from grpo.training.models import (configure_attention_kernels, configure_torch, load_policy_model, load_reference_model,
                                  load_tokenizer, stop_token_ids)
from grpo.training.settings import ModelSettings


def test_cudnn_attention_is_off():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        configure_attention_kernels()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_a_gpu_run_s_process_takes_one_thread_and_a_cpu_run_keeps_its_threads(monkeypatch):
    # vLLM's CPU worker, once started in this process (an earlier test's), replaces torch.set_num_threads with a no-op
    monkeypatch.setattr(torch, "set_num_threads", torch._C.set_num_threads)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        configure_torch(on_gpu=False)
        assert torch.get_num_threads() == 2
        configure_torch(on_gpu=True)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_stop_ids_cover_tokenizer_and_model_eos():
    class Tok:
        eos_token_id, pad_token_id = 7, 3

    class GenerationConfig:
        eos_token_id = [7, 9]

    assert stop_token_ids(Tok(), GenerationConfig()) == [3, 7, 9]
    GenerationConfig.eos_token_id = None
    assert stop_token_ids(Tok(), GenerationConfig()) == [3, 7]


def test_reference_starts_as_the_policy_and_stays_frozen(tiny_model_dir):
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}"])
    tok = load_tokenizer(cfg.model.name)
    models = ModelSettings.from_config(cfg)
    policy = load_policy_model(models, tok, torch.device("cpu"))
    ref = load_reference_model(models, tok, torch.device("cpu"))
    assert not policy.training and not ref.training  # no dropout: pi / pi_old is 1 before any update
    assert any(p.requires_grad for p in policy.parameters()) and not any(p.requires_grad for p in ref.parameters())
    policy_weights = policy.state_dict()
    assert all(torch.equal(policy_weights[name], w) for name, w in ref.state_dict().items())


@pytest.mark.parametrize("lora", [False, True])
def test_activation_checkpointing_leaves_no_grad_calls_untouched_and_still_trains(tiny_model_dir, lora):
    # One GPU samples with the trained model itself: a call under no_grad (the compiled decode step) must not set
    # requires_grad anywhere (transformers' input-embedding hook did, and torch.compile refused it on a GPU)
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", "train_model.gradient_checkpointing=true",
                                f"train_model.lora.enabled={lora}"])
    tok = load_tokenizer(cfg.model.name)
    policy = load_policy_model(ModelSettings.from_config(cfg), tok, torch.device("cpu"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert not policy.get_input_embeddings()(ids).requires_grad
    policy.train()  # HF checkpoints activations in train mode only
    policy(input_ids=ids).logits.float().pow(2).mean().backward()
    trained = {name: p for name, p in policy.named_parameters() if p.requires_grad}
    assert trained and all(p.grad is not None for p in trained.values())
    # LoRA's B starts at zero, so A's first gradient is zero too; every other trained weight gets one
    assert all(p.grad.abs().sum() > 0 for name, p in trained.items() if "lora_A" not in name)


@pytest.mark.parametrize("fraction", [0.5, 0.0])
def test_a_checkpoint_fraction_recomputes_that_share_of_the_layers_and_trains_the_same(tiny_model_dir, fraction):
    """``train_model.checkpoint_fraction``: the first share of the decoder layers runs its forward again in backward,
    the rest once; gradients are those of full checkpointing (the recompute is exact)."""
    grads, forwards = {}, {}
    for share in (1.0, fraction):
        cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", "train_model.gradient_checkpointing=true",
                                    f"train_model.checkpoint_fraction={share}"])
        policy = load_policy_model(ModelSettings.from_config(cfg), load_tokenizer(cfg.model.name), torch.device("cpu"))
        layers = policy.model.layers
        calls = [0] * len(layers)
        for index, layer in enumerate(layers):
            # on a module inside the layer: transformers 5.24 recomputes the layer's forward, not its __call__ (hooks)
            layer.mlp.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
        policy.train()
        policy(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).logits.float().pow(2).mean().backward()
        grads[share] = {name: p.grad for name, p in policy.named_parameters()}
        forwards[share] = calls
    recomputed = round(fraction * len(calls))
    assert len(calls) >= 2 and forwards[1.0] == [2] * len(calls)
    assert forwards[fraction] == [2] * recomputed + [1] * (len(calls) - recomputed)
    assert all(torch.allclose(grads[fraction][name], g, rtol=1e-5, atol=1e-7) for name, g in grads[1.0].items())
