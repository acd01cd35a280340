"""The inference side: the sampling policy for rollouts, the greedy one for eval, and weight sync."""

from __future__ import annotations

import copy
import time

import torch

from grpo.models import compiled_decode_kwargs, generate_kwargs, make_transformers_policy, stop_token_ids, torch_dtype


class TransformersInference:
    """Generation with transformers' ``generate``.

    When generation runs on the training device in the same dtype, it uses the training
    model object itself, so updated weights are seen at once and a push costs nothing.
    Otherwise it holds its own copy on its device and a push copies the weights over: that is
    the default on a GPU, where float32 master weights train and a bfloat16 copy generates.
    """

    def __init__(self, cfg, policy_model, tokenizer, device: torch.device):
        train_device = next(policy_model.parameters()).device
        dtype = torch_dtype(cfg.inference_model.dtype, device)
        if device == train_device and dtype == next(policy_model.parameters()).dtype:
            self.model = policy_model
        else:
            self.model = copy.deepcopy(_merged(policy_model)).to(device=device, dtype=dtype).eval().requires_grad_(False)
        decode = compiled_decode_kwargs(cfg, self.model)
        stop_ids = stop_token_ids(tokenizer, self.model.generation_config)
        self.policy = make_transformers_policy(self.model, tokenizer, gen_kwargs={**generate_kwargs(
            cfg, tokenizer, greedy=False, max_new_tokens=cfg.inference_model.max_new_tokens, stop_ids=stop_ids), **decode})
        self.greedy_policy = make_transformers_policy(self.model, tokenizer, gen_kwargs={**generate_kwargs(
            cfg, tokenizer, greedy=True, max_new_tokens=cfg.eval.max_new_tokens, stop_ids=stop_ids), **decode})
        self.version = 0

    @torch.no_grad()
    def push_weights(self, source, version: int | None = None) -> float:
        """Make generation use new weights (a model, or a plain HF state dict); returns the seconds it took."""
        start = time.perf_counter()
        if source is not self.model:  # the very same module needs no copy (sync, same device)
            weights = source if isinstance(source, dict) else inference_state_dict(source)
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(weights[name])
        self.version = self.version + 1 if version is None else version
        return time.perf_counter() - start

    def shutdown(self) -> None:
        pass


def weights_checksum(weights: dict) -> float:
    """A float64 sum over every tensor: equal sums on both sides show a push arrived."""
    return float(sum(weights[k].detach().double().sum().item() for k in sorted(weights)))


def inference_state_dict(policy_model) -> dict:
    """The weights an inference engine needs: HF parameter names, LoRA adapters merged in.

    Under LoRA only the adapted weights are computed afresh (``W + delta``); the rest are the
    policy's own tensors, not a copy of the whole model per push.
    """
    if hasattr(policy_model, "merge_and_unload"):
        from grpo.vllm_backend import merged_state_dict

        return merged_state_dict(policy_model)
    return policy_model.state_dict()


def _merged(policy_model):
    """A plain HF model with LoRA adapters folded in (a copy), or the model itself without LoRA."""
    if hasattr(policy_model, "merge_and_unload"):
        return copy.deepcopy(policy_model).merge_and_unload()
    return policy_model


def make_inference(cfg, policy_model, tokenizer, device: torch.device):
    if cfg.inference_model.backend == "transformers":
        return TransformersInference(cfg, policy_model, tokenizer, device)
    from grpo.vllm_backend import VLLMInference

    return VLLMInference(cfg, policy_model, tokenizer, device)
