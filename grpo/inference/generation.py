"""What every generation engine shares: its interface, the sampling options, and the weights it is sent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from grpo.training.models import inference_state_dict


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built from, read from the config in one place (``from_config``): engines,
    rollout workers and their tests take these, never the config itself."""
    model_name: str               # the files an engine loads (its weights are then pushed)
    backend: str                  # transformers or vllm
    dtype: str                    # on a GPU; the CPU always float32
    max_new_tokens: int           # rollouts' reply cap
    eval_max_new_tokens: int      # eval's reply cap
    temperature: float
    eval_temperature: float       # the sampled eval's (eval.samples_per_problem)
    top_p: float
    top_k: int                    # 0 = off
    compile: bool                 # transformers: the decode step as a CUDA graph
    cache_bucket: int             # transformers: KV-cache length rounded up to this
    compile_prefill: bool         # transformers: the prompts' forward compiled too (with ``compile``)
    compact_rows: bool            # transformers: rows whose reply ended leave the decode batch
    continuous_turns: bool        # transformers: an episode's next turn joins the decode batch when its answer is back
    fuse_shared: bool             # transformers: a policy it shares samples through fused q/k/v and gate/up copies
    max_model_len: int            # vLLM: prompt + reply
    gpu_memory_utilization: float  # vLLM
    enforce_eager: bool           # vLLM: no CUDA graphs
    cpu_kvcache_space_gb: float   # vLLM's CPU build
    vllm_log_level: str
    seed: int

    @classmethod
    def from_config(cls, cfg) -> EngineSettings:
        im = cfg.inference_model
        return cls(model_name=cfg.model.name, backend=im.backend, dtype=im.dtype, max_new_tokens=im.max_new_tokens,
                   eval_max_new_tokens=cfg.eval.max_new_tokens, temperature=im.temperature,
                   eval_temperature=cfg.eval.temperature, top_p=im.top_p,
                   top_k=im.top_k, compile=im.compile, compile_prefill=im.compile_prefill, cache_bucket=im.cache_bucket,
                   compact_rows=im.compact_rows, continuous_turns=im.continuous_turns, fuse_shared=im.fuse_shared,
                   max_model_len=im.max_model_len, gpu_memory_utilization=im.gpu_memory_utilization,
                   enforce_eager=im.enforce_eager,
                   cpu_kvcache_space_gb=im.cpu_kvcache_space_gb, vllm_log_level=im.vllm_log_level, seed=cfg.seed)


@runtime_checkable
class InferenceEngine(Protocol):
    """A generation engine as the scripts, eval and rollout workers use it, whatever its backend
    (``grpo.inference.engine.TransformersInference``, ``grpo.inference.vllm_backend.VLLMInference``).

    ``policy`` samples rollouts, ``greedy_policy`` evaluates and ``sampled_eval_policy`` samples eval replies at
    ``eval.temperature`` (pass@k): TorchRL policies taking chat histories
    and returning replies with their sampled tokens' log-probs. ``version`` is the weights version last
    pushed (``None``: the model files' weights, none pushed yet). ``generate_s``: the seconds spent so far
    inside the engine's own generate calls (both policies'); the rest of a collection is the policy around them
    (chat template, tokenizing, decoding the replies into chat histories), the env and its reward.
    ``on_sampled``: ``None``, or called with each batch ``policy`` samples as soon as the engine returns it: its
    prompts' and replies' token ids, a list of CPU tensors each (the reference scores them meanwhile:
    ``grpo.training.reference``).
    """

    policy: object
    greedy_policy: object
    sampled_eval_policy: object
    version: int | None
    generate_s: float
    on_sampled: object

    def push_weights(self, source, version: int) -> float:
        """Generate with new weights (a model, or HF-named tensors); returns the seconds it took."""

    def weights_checksum(self) -> int:
        """``weights_checksum`` of the weights the engine generates with, read from the engine itself."""

    def shutdown(self) -> None:
        """Free the engine."""


def generate_kwargs(settings: EngineSettings, tokenizer, *, greedy: bool, max_new_tokens: int,
                    stop_ids: list[int], temperature: float | None = None) -> dict:
    """``generate`` options for rollouts (sampled) or eval (greedy, or sampled at ``temperature``), with every
    sampling knob explicit.

    ``pad_token_id`` is the tokenizer's: a model's ``generation_config`` may pad with another id
    (SmolLM2 pads with its eos), and TorchRL strips only the tokenizer's pad from replies, so
    finished replies came back followed by runs of eos that counted as reply tokens. ``top_k`` is
    always passed: transformers' default of 50 would otherwise truncate the sampler silently.
    """
    common = {"max_new_tokens": max_new_tokens, "eos_token_id": stop_ids, "pad_token_id": tokenizer.pad_token_id}
    if greedy:
        return {**common, "do_sample": False}
    s = settings
    return {**common, "do_sample": True, "temperature": s.temperature if temperature is None else temperature,
            "top_p": s.top_p, "top_k": s.top_k}


def as_state_dict(source) -> dict[str, torch.Tensor]:
    """The HF-named weights a push sends: a state dict as it is, a model (or a whole ``Trainer.engine_weights``
    of a sharded one, already a dict) through ``inference_state_dict``."""
    return source if isinstance(source, dict) else inference_state_dict(source)


def tensor_place(tensor: torch.Tensor) -> tuple:
    """Where a tensor's values live: equal for two names of one tied weight."""
    return tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.stride()


def distinct_tensors(weights: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once, in name order: tied weights (the LM head sharing the embedding) appear under two
    names, and an engine holding them once must checksum the same."""
    seen, tensors = set(), []
    for name in sorted(weights):
        tensor = weights[name]
        place = tensor_place(tensor)
        if place not in seen:
            seen.add(place)
            tensors.append(tensor)
    return tensors


def tensor_bits_sum(tensor: torch.Tensor) -> int:
    """The sum of a tensor's elements read as integers of their width: exact, so it does not depend on
    the order of summation, and zeros add nothing."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]
    return int(tensor.detach().contiguous().view(as_int).sum(dtype=torch.int64))


def weights_checksum(tensors) -> int:
    """The checksum an engine reports of the weights it holds and the trainer of those it sends.

    Bit patterns summed as integers are the same however an engine lays the weights out: vLLM fuses
    q/k/v and gate/up into one tensor each and pads the vocabulary with zero rows. ``tensors``: a dict of
    HF-named weights (tied ones counted once) or the engine's own distinct tensors.
    """
    if isinstance(tensors, dict):
        tensors = distinct_tensors(tensors)
    return sum(tensor_bits_sum(tensor) for tensor in tensors) % 2**64  # int64 sums of huge tensors wrap
