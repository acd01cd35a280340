"""What every generation engine shares: the sampling options, and the weights it is sent."""

from __future__ import annotations

import torch


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


def inference_state_dict(policy_model) -> dict[str, torch.Tensor]:
    """The weights a generation engine needs: HF parameter names, LoRA adapters merged in.

    Under LoRA only the adapted weights are computed afresh (``W + delta``); the rest are the
    policy's own tensors, not a copy of the whole model per push.
    """
    if hasattr(policy_model, "merge_and_unload"):
        return merged_state_dict(policy_model)
    return policy_model.state_dict()


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


def weights_checksum(weights: dict) -> float:
    """A float64 sum over every tensor: equal sums on both sides show a push arrived."""
    return float(sum(weights[k].detach().double().sum().item() for k in sorted(weights)))
