"""Building the tokenizer, the policy (train), reference and inference models, and their TorchRL wrappers."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence
from torchrl.modules.llm import TransformersWrapper
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.data import looks_local


class ModelLoadError(RuntimeError):
    """The model or tokenizer named in the config cannot be loaded."""


def _check_model_name(name: str) -> None:
    if looks_local(name) and not Path(name).expanduser().exists():
        raise ModelLoadError(
            f"model.name={name!r}: no such folder. Give a local folder holding config.json and the "
            "weights, or a hub name such as Qwen/Qwen2.5-0.5B-Instruct (needs network or a warm HF cache)."
        )


def load_tokenizer(name: str):
    _check_model_name(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except OSError as err:
        raise ModelLoadError(f"model.name={name!r}: cannot load its tokenizer ({err}). Offline? Pass a local path.") from err
    if tokenizer.pad_token is None or tokenizer.pad_token == tokenizer.eos_token:
        # A pad equal to eos would make the attention mask drop real eos tokens of finished answers.
        tokenizer.add_special_tokens({"pad_token": "<|endoftext|>"}) if "<|endoftext|>" in tokenizer.get_vocab() \
            else tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
    tokenizer.padding_side = "left"
    return tokenizer


def configure_attention_kernels(cfg) -> None:
    """Which kernels ``scaled_dot_product_attention`` may pick on a GPU (process-wide).

    PyTorch prefers cuDNN's attention on Hopper, and cuDNN builds an execution plan for every new
    input shape: about 0.8 ms of CPU per forward call and 1.9 ms per backward, measured on an H200
    with a 0.5B model. An RL step meets new shapes all the time (every decode step of eager
    generation, every micro-batch trimmed to its own width), so those plans cost seconds per step
    until the shapes repeat. The flash and memory-efficient kernels need no plan.
    """
    torch.backends.cuda.enable_cudnn_sdp(bool(cfg.model.cudnn_attention))


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """Half precision is for GPUs; on CPU every model runs in float32."""
    return torch.float32 if device.type == "cpu" else getattr(torch, name)


def load_causal_lm(name: str, tokenizer, *, dtype: torch.dtype, device: torch.device,
                   shard_over: list[int] | None = None):
    """A causal LM on ``device``, or split layer-wise over the GPUs ``shard_over`` (HF device_map).

    Its embeddings grow to the tokenizer when ``load_tokenizer`` added a pad token, so the
    policy, the reference and every inference copy have the same parameter shapes.
    """
    _check_model_name(name)
    kwargs = {}
    if shard_over and len(shard_over) > 1:
        # Layer-wise model parallelism: accelerate places consecutive layers on each GPU and moves
        # activations between them, so a model larger than one GPU trains without FSDP processes.
        kwargs = {"device_map": "balanced", "max_memory": {i: torch.cuda.get_device_properties(i).total_memory
                                                             for i in shard_over}}
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **kwargs)
    except OSError as err:
        raise ModelLoadError(f"model.name={name!r}: cannot load the model ({err}). Offline? Pass a local path.") from err
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    return model if kwargs else model.to(device)


def load_policy_model(cfg, tokenizer, device: torch.device, shard_over: list[int] | None = None):
    """The trained model: full weights or LoRA adapters, optionally with gradient checkpointing.

    It stays in eval mode (no dropout: the ratio pi_theta / pi_old must be 1 before any update);
    ``grpo.trainer.optimize_on_batch`` switches it to train mode only while it optimises, because
    HF checkpoints activations only in train mode and, in train mode, ``generate`` drops its KV
    cache (a one-GPU run generates with this very object: it crashed, on CPU it produced garbage).
    """
    model = load_causal_lm(cfg.model.name, tokenizer, dtype=torch_dtype(cfg.train_model.dtype, device), device=device,
                           shard_over=shard_over)
    if cfg.train_model.lora.enabled:
        from peft import LoraConfig, get_peft_model

        lora = cfg.train_model.lora
        model = get_peft_model(model, LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
            target_modules=list(lora.target_modules), task_type="CAUSAL_LM",
        ))
    if cfg.train_model.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.eval()


def load_reference_model(cfg, tokenizer, device: torch.device):
    """The starting policy, frozen: loaded from ``model.name`` again (also the base of LoRA runs).

    Loading rather than copying the policy keeps it the *initial* model on resume, and works
    when the policy is split over several GPUs.
    """
    ref = load_causal_lm(cfg.model.name, tokenizer, dtype=torch_dtype(cfg.ref_model.dtype, device), device=device)
    return ref.eval().requires_grad_(False)


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


def stop_token_ids(tokenizer, generation_config) -> list[int]:
    """Every id that ends a reply: the tokenizer's eos and pad, and the model's own eos ids.

    Models list several (Qwen2.5: ``<|im_end|>`` and ``<|endoftext|>``; Llama 3 its end-of-turn
    ids) in ``generation_config.eos_token_id``, which ``generate`` would otherwise use. A sampled
    pad must end the reply too: TorchRL strips pad ids when it unpads replies, so a pad inside one
    would shift every later token against its log-prob.
    """
    model_eos = getattr(generation_config, "eos_token_id", None)
    model_eos = [] if model_eos is None else [model_eos] if isinstance(model_eos, int) else list(model_eos)
    return sorted({tokenizer.eos_token_id, tokenizer.pad_token_id, *model_eos} - {None})


def generate_kwargs(cfg, tokenizer, *, greedy: bool, max_new_tokens: int, stop_ids: list[int]) -> dict:
    """``generate`` options for rollouts (sampled) or eval (greedy), with every sampling knob explicit.

    ``pad_token_id`` is the tokenizer's: a model's ``generation_config`` may pad with another id
    (SmolLM2 pads with its eos), and TorchRL strips only the tokenizer's pad from replies, so
    finished replies came back followed by runs of eos that counted as reply tokens. ``top_k`` is
    always passed: transformers' default of 50 would otherwise truncate the sampler silently.
    """
    common = {"max_new_tokens": max_new_tokens, "eos_token_id": stop_ids, "pad_token_id": tokenizer.pad_token_id}
    if greedy:
        return {**common, "do_sample": False}
    im = cfg.inference_model
    return {**common, "do_sample": True, "temperature": im.temperature, "top_p": im.top_p, "top_k": im.top_k}


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


def reply_log_probs(model, batch, *, with_entropy: bool, entropy_grad: bool = True, forward=None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[S, R]`` log pi(reply token | everything before it), and the per-token entropy if asked.

    ``batch`` is the dense layout of ``grpo.rollouts`` (replies start at column ``P``). Only the
    last ``R + 1`` positions go through the LM head (``logits_to_keep``): the prompt positions'
    logits, which TorchRL's wrapper materialises over the whole vocabulary, are never needed.
    ``entropy_grad=False`` keeps the full-vocabulary entropy out of the autograd graph (it is then
    only logged), which saves its backward and its activations. ``forward`` replaces
    ``token_log_probs`` (the trainer passes its compiled version).
    """
    forward = forward or token_log_probs
    return forward(model, batch["input_ids"], batch["attention_mask"], batch["reply_mask"].shape[1],
                   with_entropy=with_entropy, entropy_grad=entropy_grad)


def token_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, width_r: int, *,
                    with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``reply_log_probs`` on plain tensors: the region ``train_model.compile`` compiles."""
    # positions count real tokens only, as in generation from left-padded prompts
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask.long(), position_ids=position_ids,
                   logits_to_keep=width_r + 1, use_cache=False).logits[:, :-1].float()
    targets = input_ids[:, input_ids.shape[1] - width_r:].to(logits.device)
    # log-softmax at the target only: the backward needs no [S, R, V] log-prob tensor
    token_lp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    # a model split over GPUs returns logits on its last one; the batch lives on the first
    token_lp = token_lp.to(input_ids.device)
    if not with_entropy:
        return token_lp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        log_probs = logits.log_softmax(-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return token_lp, entropy.to(input_ids.device)
