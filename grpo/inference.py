"""Generation with transformers: TorchRL's wrapper for rollouts and eval, weight pushes, and the
choice of engine (``inference_model.backend``: this one, or ``grpo.vllm_backend``)."""

from __future__ import annotations

import time

import torch
from torch.nn.utils.rnn import pad_sequence
from torchrl.modules.llm import TransformersWrapper

from grpo.generation import generate_kwargs, inference_state_dict
from grpo.models import load_causal_lm, torch_dtype


def make_inference(cfg, policy_model, tokenizer, device: torch.device, stop_ids: list[int]):
    """The generation engine ``inference_model.backend`` names, holding ``policy_model``'s weights."""
    if cfg.inference_model.backend == "transformers":
        return TransformersInference(cfg, policy_model, tokenizer, device, stop_ids)
    from grpo.vllm_backend import VLLMInference

    return VLLMInference(cfg, policy_model, tokenizer, device, stop_ids)


class TransformersInference:
    """Generation with transformers' ``generate``: ``policy`` samples rollouts, ``greedy_policy`` evaluates.

    When generation runs on the training device in the same dtype, it uses the training model
    object itself, so updated weights are seen at once and a push costs nothing. Otherwise it loads
    its own copy on its device (in its dtype: a copy of float32 master weights would first need
    their full size again on the GPU) and a push copies the weights over: that is the default on a
    GPU, where float32 master weights train and a bfloat16 copy generates.
    """

    def __init__(self, cfg, policy_model, tokenizer, device: torch.device, stop_ids: list[int]):
        dtype = torch_dtype(cfg.inference_model.dtype, device)
        param = next(policy_model.parameters())
        if device == param.device and dtype == param.dtype:
            self.model = policy_model
        else:
            self.model = load_causal_lm(cfg.model.name, tokenizer, dtype=dtype, device=device)
            self.model.eval().requires_grad_(False)
        decode = compiled_decode_kwargs(cfg, self.model)
        self.policy = make_transformers_policy(self.model, tokenizer, gen_kwargs={**generate_kwargs(
            cfg, tokenizer, greedy=False, max_new_tokens=cfg.inference_model.max_new_tokens, stop_ids=stop_ids), **decode})
        self.greedy_policy = make_transformers_policy(self.model, tokenizer, gen_kwargs={**generate_kwargs(
            cfg, tokenizer, greedy=True, max_new_tokens=cfg.eval.max_new_tokens, stop_ids=stop_ids), **decode})
        self.push_weights(policy_model, version=0)

    @torch.no_grad()
    def push_weights(self, source, version: int) -> float:
        """Make generation use new weights (a model, or a plain HF state dict); returns the seconds it took."""
        start = time.perf_counter()
        if source is not self.model:  # the very same module needs no copy
            weights = source if isinstance(source, dict) else inference_state_dict(source)
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(weights[name])
        self.version = version
        return time.perf_counter() - start

    def shutdown(self) -> None:
        pass


class GeneratingWrapper(TransformersWrapper):
    """TorchRL's transformers wrapper with the first generated token's log-prob kept.

    TorchRL 0.14.1 sets ``log_probs[:, 0] = 0`` in ``_log_probs_generate``: the first
    response token then has behaviour log-prob 0 (probability 1), so its importance ratio
    is pi_theta(token) instead of ~1 and it is always clipped. We compute every position.
    """

    def forward(self, tensordict, *args, **kwargs):
        out = super().forward(tensordict, *args, **kwargs)
        if self._device is None or torch.device(self._device).type == "cpu":
            return out
        # rollouts leave the accelerator right away: envs, rewards and buffers live on the CPU. The
        # env's tensordicts have no device, so neither may this one (tensordict refuses to mix them).
        return out.to("cpu").clear_device_()

    @classmethod
    def _log_probs_generate(cls, tokens, logits, pad_val=-100, pad=True):
        if pad:
            tokens = pad_sequence(tokens, padding_value=pad_val, batch_first=True, padding_side="left")
            logits = pad_sequence(logits, padding_value=0.0, batch_first=True, padding_side="left")
        valid = tokens != pad_val
        index = tokens.clamp_min(0).unsqueeze(-1)
        # one sample at a time: a [T, V] float32 slice instead of a [B, T, V] log-softmax (on a
        # 151k vocabulary that whole tensor was the run's peak GPU memory)
        log_probs = torch.stack([row.gather(-1, idx).squeeze(-1).float() - row.float().logsumexp(-1)
                                 for row, idx in zip(logits, index)])
        return torch.where(valid, log_probs, 0.0), logits


def compiled_decode_kwargs(cfg, model) -> dict:
    """``generate`` options that put the decode step under ``torch.compile`` with CUDA graphs.

    Eager decoding of a small model is bound by Python and kernel launches, not by the GPU: a 0.5B
    model took about 20 ms a token for 64 replies on an H200. A static KV cache gives the step fixed shapes,
    which lets transformers compile it ("reduce-overhead": one CUDA-graph replay per token; the
    prefill stays eager). Only on a single CUDA device: transformers compiles nothing on CPU, and
    a model split over GPUs (``hf_device_map``) is left eager. ``max_cache_len`` sizes the cache
    once for the longest prompt plus reply, so longer prompts later reuse it instead of recompiling.
    """
    device = next(model.parameters()).device
    if not cfg.inference_model.compile or device.type != "cuda" or len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return {}
    return {"cache_implementation": "static", "max_cache_len": cfg.inference_model.max_model_len}


def make_transformers_policy(model, tokenizer, *, gen_kwargs: dict):
    """Generation in history mode: chat prompts in, sampled replies plus their log-probs out."""
    # TorchRL 0.14 refuses top_k=0 (transformers' "off") and silently drops the generate() options
    # it does not know (cache_implementation, max_cache_len): it gets what it accepts, and
    # generate() then gets every option as given.
    policy = GeneratingWrapper(
        model, tokenizer=tokenizer, input_mode="history", generate=True, return_log_probs=True,
        pad_output=False, generate_kwargs={k: v for k, v in gen_kwargs.items() if (k, v) != ("top_k", 0)},
        # without it the prompts stay on the CPU and sampling over the vocabulary runs there
        device=next(model.parameters()).device,
    )
    policy.generate_kwargs.update(gen_kwargs)
    return policy
