"""Loading the tokenizer and the models (the trained policy, the frozen reference, generation copies), the modes
a model runs in (autocast, train mode), and the policy's weights as engines are sent them and an export writes them
(``inference_state_dict``: HF names, whole tensors, LoRA merged)."""

from __future__ import annotations

import contextlib
from functools import partial
from itertools import chain

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_layers import GradientCheckpointingLayer

from grpo.process.errors import ModelLoadError
from grpo.process.world import full, is_sharded
from grpo.training.attention import use_project_attention
from grpo.training.settings import ModelSettings
from grpo.tasks.paths import check_model_folder


def load_tokenizer(name: str):
    check_model_folder(name)
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


def configure_torch(*, on_gpu: bool) -> None:
    """Process-wide torch settings of a run's process: the attention kernels (``configure_attention_kernels``) and,
    in a process of a GPU run, one CPU thread (a CPU run keeps torch's default, one per core).

    Such a process's CPU tensor work is bookkeeping: micro-batches indexed, masks laid out. For it torch woke one
    OpenMP thread per core, and on an H100 host (16 cores) ten 16-row indexings took ~0.15 ms at the median but up to
    52 ms with 16 threads, at most 0.7 ms with one; before most of the 1.5B bench step's 16 training micro-batches the
    GPU sat idle 15-51 ms while they ran, and the step took 7.33 s against 6.80 s (benchmarks/README.md)."""
    configure_attention_kernels()
    if on_gpu:
        torch.set_num_threads(1)


def configure_attention_kernels() -> None:
    """Which kernels ``scaled_dot_product_attention`` may pick on a GPU (process-wide): not cuDNN's.

    PyTorch prefers cuDNN's attention on Hopper, and cuDNN builds an execution plan for every new
    input shape: about 0.8 ms of CPU per forward call and 1.9 ms per backward, measured on an H200
    with a 0.5B model. An RL step meets new shapes all the time (every decode step of eager
    generation, every micro-batch trimmed to its own width), so those plans cost seconds per step
    until the shapes repeat. The flash and memory-efficient kernels need no plan.
    """
    torch.backends.cuda.enable_cudnn_sdp(False)


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    """Half precision is for GPUs; on CPU every model runs in float32."""
    return torch.float32 if device.type == "cpu" else getattr(torch, name)


def load_causal_lm(name: str, tokenizer, *, dtype: torch.dtype, device: torch.device):
    """A causal LM on ``device``.

    Its embeddings grow to the tokenizer when ``load_tokenizer`` added a pad token, so the
    policy, the reference and every inference copy have the same parameter shapes. It attends with
    ``grpo.training.attention`` (SDPA, plus packed rows and decoding's grouped heads).
    """
    check_model_folder(name)
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except OSError as err:
        raise ModelLoadError(f"model.name={name!r}: cannot load the model ({err}). Offline? Pass a local path.") from err
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    use_project_attention(model)
    return model.to(device)


def load_policy_model(settings: ModelSettings, tokenizer, device: torch.device):
    """The trained model: full weights or LoRA adapters, optionally with gradient checkpointing.

    It stays in eval mode (no dropout: the ratio pi_theta / pi_old must be 1 before any update);
    ``GRPOStep.optimize`` (grpo.training.step) switches it to train mode only while it optimises, because
    HF checkpoints activations only in train mode and, in train mode, ``generate`` drops its KV
    cache (a one-GPU run generates with this very object: it crashed, on CPU it produced garbage).
    """
    model = load_causal_lm(settings.name, tokenizer, dtype=torch_dtype(settings.policy_dtype, device), device=device)
    if settings.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(
            r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
            target_modules=list(settings.lora_target_modules), task_type="CAUSAL_LM",
        ))
    if settings.gradient_checkpointing:
        enable_activation_checkpointing(model, settings.checkpoint_fraction)
    return model.eval()


def enable_activation_checkpointing(model, fraction: float = 1.0) -> None:
    """Recompute activations in backward (non-reentrant) in the first ``fraction`` of the decoder layers; the others
    keep theirs: each layer left out saves its recompute and costs its activations. transformers 5.24 renamed
    ``gradient_checkpointing_enable`` (the old name warns), the GPU machines run 5.17."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # Both also hook the input embeddings to set requires_grad on their output, which only reentrant
    # checkpointing needs. Where the sampler is this very model (one GPU, same dtype), the hook runs in the
    # compiled decode step and torch.compile refuses it (H200, torch 2.11: "Unsupported Tensor.requires_grad_()").
    model.disable_input_require_grads()
    # each decoder layer checks its own flag (transformers' GradientCheckpointingLayer, 5.17 and 5.24 alike)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    recomputed = round(fraction * len(layers))
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < recomputed


def compiled(fn):
    """``fn`` compiled with dynamic shapes: micro-batches are trimmed to their own widths, so one graph serves them all."""
    return torch.compile(fn, dynamic=True)


def compiled_with_grad(fn):
    """``fn``, compiled (dynamic shapes) where grad is enabled, eager where not."""
    return partial(_compiled_with_grad, fn, compiled(fn))


def _compiled_with_grad(eager, compiled_fn, *args, **kwargs):
    return (compiled_fn if torch.is_grad_enabled() else eager)(*args, **kwargs)


def compile_decoder_layers(model, compile_fn=compiled_with_grad) -> None:
    """``torch.compile`` each decoder layer's forward, by default for the passes that build a graph (training's).

    Per layer, not the whole model: the layers run the same code, so dynamo compiles one graph for all of
    them (24 layers on CPU: 38 s against 280 s for the whole model, the same log-probs; 1.5B on an H100:
    ~20 s against ~290 s), and what wraps a layer's forward stays eager: checkpointing's recompute calls the
    compiled forward again, FSDP2's gathers run in its hooks. Passes without grad (generation from this
    very model where the sampler shares it, scoring) keep the eager forward: a KV cache is another graph.
    ``compile_fn=compiled`` compiles every pass: for a model that never generates (the reference)."""
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            layer.forward = compile_fn(layer.forward)


def load_reference_model(settings: ModelSettings, tokenizer, device: torch.device):
    """The starting policy, frozen: loaded from ``model.name`` again (also the base of LoRA runs).

    Loading rather than copying the policy keeps it the *initial* model on resume, and works
    when the policy is sharded over ranks.
    """
    ref = load_causal_lm(settings.name, tokenizer, dtype=torch_dtype(settings.reference_dtype, device), device=device)
    return ref.eval().requires_grad_(False)


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


def mixed_precision_dtype(enabled: bool, model) -> torch.dtype | None:
    """bfloat16, the dtype the model's passes autocast to with ``train_model.mixed_precision``, for float32 weights
    on a GPU; else None. Weights already in bf16 gain nothing from it but a dispatch per op: about 10% of the
    training time of a 0.5B model, measured on an H200."""
    param = next(model.parameters())
    return torch.bfloat16 if enabled and param.device.type == "cuda" and param.dtype == torch.float32 else None


@contextlib.contextmanager
def train_mode_if(model, enabled: bool):
    """Train mode for the duration, when gradient checkpointing needs it (HF checkpoints only in
    train mode); the model is otherwise kept in eval mode, where ``generate`` keeps its KV cache."""
    model.train(enabled)
    try:
        yield
    finally:
        model.eval()


def inference_state_dict(policy_model) -> dict[str, torch.Tensor]:
    """The weights a generation engine needs: HF parameter names, whole tensors, LoRA adapters merged in.

    A policy sharded over data-parallel ranks (FSDP2) is gathered whole on every rank: a collective,
    so every rank calls this for each push. Under LoRA only the adapted weights are computed afresh
    (``W + delta``); the rest are the policy's own tensors, not a copy of the whole model per push.
    """
    if hasattr(policy_model, "merge_and_unload"):
        return merged_state_dict(policy_model)
    if not is_sharded(policy_model):
        return policy_model.state_dict()
    # one gather per tensor, keyed by the parameter: a tied weight (the LM head sharing the embedding) stays
    # one tensor under both names, as the engines and the checksum count it
    names = policy_model.state_dict().keys()
    gathered, state = {}, {}
    for name, tensor in chain(policy_model.named_parameters(remove_duplicate=False),
                              policy_model.named_buffers(remove_duplicate=False)):
        if name in names:
            if id(tensor) not in gathered:
                gathered[id(tensor)] = full(tensor.detach())
            state[name] = gathered[id(tensor)]
    return state


@torch.no_grad()
def merged_state_dict(peft_model) -> dict[str, torch.Tensor]:
    """HF-named state dict of a PEFT (LoRA) model with the active adapters merged in.

    The model itself is left untouched: only the LoRA-targeted weights are copied
    (``W + get_delta_weight(adapter)``); the others are shared with the model.
    """
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    deltas: dict[str, torch.Tensor] = {}
    for mod_name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not getattr(module, "merged", False):
            for adapter in module.active_adapters:
                if adapter in module.lora_A and not module.disable_adapters:
                    d = module.get_delta_weight(adapter)
                    key = f"{mod_name}.weight"
                    deltas[key] = deltas[key] + d if key in deltas else d
    active = set(getattr(peft_model, "active_adapters", None) or ["default"])
    out: dict[str, torch.Tensor] = {}
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        if ".modules_to_save." in name:  # trained copy of a module: keep the active one
            head, _, rest = name.partition(".modules_to_save.")
            adapter, _, tail = rest.partition(".")
            if adapter not in active:
                continue
            name = f"{head}.{tail}"
        elif ".original_module." in name:
            continue
        name = name.replace(".base_layer.", ".")
        if name in deltas:
            tensor = tensor + deltas[name].to(tensor.dtype)
        out[name] = tensor
    return out
