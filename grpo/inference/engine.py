"""Generation with transformers: our decode loop and TorchRL policy for rollouts and eval, weight pushes, and the
choice of engine (``inference_model.backend``: this one, or ``grpo.inference.vllm_backend``)."""

from __future__ import annotations

import time

import torch

from grpo.inference.decoding import ReplySampler
from grpo.inference.episode_policy import EnginePolicies, EpisodePolicy, pad_prompts
from grpo.inference.generation import EngineSettings, InferenceEngine, as_state_dict, generate_kwargs, weights_checksum
from grpo.inference.turn_streaming import sample_continuously
from grpo.process.world import is_sharded
from grpo.training.models import load_causal_lm, torch_dtype


def make_inference(settings: EngineSettings, policy_model, tokenizer, device: torch.device,
                   stop_ids: list[int]) -> InferenceEngine:
    """The generation engine ``settings.backend`` names. It starts with ``policy_model``'s weights (a model, or
    an HF state dict), or with ``None`` (a rollout worker, sent its weights later) with those of the
    ``settings.model_name`` files."""
    if settings.backend == "transformers":
        return TransformersInference(settings, policy_model, tokenizer, device, stop_ids)
    from grpo.inference.vllm_backend import VLLMInference

    return VLLMInference(settings, policy_model, tokenizer, device, stop_ids)


class TransformersInference(EnginePolicies):
    """Generation with transformers models and our decode loop (``grpo.inference.decoding``): an ``InferenceEngine``.

    When generation runs on the training device in the same dtype, it uses the training model
    object itself, so updated weights are seen at once and a push costs nothing; not when the policy
    is sharded over data-parallel ranks (each forward would gather from the others). Otherwise it loads
    its own copy on its device (in its dtype: a copy of float32 master weights would first need
    their full size again on the GPU) and a push copies the weights over: that is the default on a
    GPU, where float32 master weights train and a bfloat16 copy generates.
    """

    def __init__(self, settings: EngineSettings, policy_model, tokenizer, device: torch.device, stop_ids: list[int]):
        """``policy_model``: the weights to start with, a model or an HF state dict (``None``: the files')."""
        s = settings
        dtype = torch_dtype(s.dtype, device)
        param = next(policy_model.parameters()) if isinstance(policy_model, torch.nn.Module) else None
        if param is not None and device == param.device and dtype == param.dtype and not is_sharded(policy_model):
            self.model = policy_model
        else:
            self.model = load_causal_lm(s.model_name, tokenizer, dtype=dtype, device=device)
            self.model.eval().requires_grad_(False)
        self.sampler = sampler = ReplySampler(self.model, compile=s.compile, compile_prefill=s.compile_prefill,
                                              cache_bucket=s.cache_bucket,
                                              compact_rows=s.compact_rows, fuse_shared=s.fuse_shared)
        self.policy, self.greedy_policy, self.sampled_eval_policy = (
            make_transformers_policy(sampler, tokenizer, gen_kwargs=generate_kwargs(
                s, tokenizer, greedy=greedy, max_new_tokens=cap, stop_ids=stop_ids, temperature=temperature),
                continuous_turns=s.continuous_turns)
            for greedy, cap, temperature in ((False, s.max_new_tokens, s.temperature),
                                             (True, s.eval_max_new_tokens, None),
                                             (False, s.eval_max_new_tokens, s.eval_temperature)))
        self.version = None
        if policy_model is not None:
            self.push_weights(policy_model, version=0)

    @property
    def generate_s(self) -> float:
        return self.sampler.seconds

    @torch.no_grad()
    def push_weights(self, source, version: int) -> float:
        """Make generation use new weights (a model, or a plain HF state dict); returns the seconds it took."""
        start = time.perf_counter()
        if source is not self.model:  # the very same module needs no copy
            weights = as_state_dict(source)
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(weights[name])
        self.version = version
        return time.perf_counter() - start

    @torch.no_grad()
    def weights_checksum(self) -> int:
        """Of the weights the decode loop reads: with fused projections, views of the fused GEMM's weight."""
        return weights_checksum(self.model.state_dict())

    def shutdown(self) -> None:
        pass


def make_transformers_policy(sampler: ReplySampler, tokenizer, *, gen_kwargs: dict,
                             continuous_turns: bool = True) -> EpisodePolicy:
    """The episode policy over ``sampler`` with ``generate_kwargs`` (sampled or greedy; the reply cap a turn). Its
    tensors stay on the CPU, where envs, rewards and buffers live: the sampler takes each turn's prompts to its GPU
    and hands back the replies as CPU tensors. ``continuous_turns``: an episode's next turn joins the decode batch as
    soon as its answer is back (``grpo.inference.turn_streaming``; a model with sliding-window layers, whose cache
    slots are not positions, samples by turns); else every episode's turn k, then their turn k+1."""
    pad = gen_kwargs["pad_token_id"]

    def sample(prompts: list[torch.Tensor], max_new_tokens: int, batch_rows: int):
        """``prompts``: the episodes of a batch of ``batch_rows`` still going (all of them on the first turn)."""
        rows = len(prompts)
        prompts = prompts + [prompts[-1]] * (sampler.decode_rows(rows, batch_rows) - rows)
        input_ids, attention_mask = pad_prompts(prompts, pad)
        out = sampler.generate(input_ids, attention_mask, **{**gen_kwargs, "max_new_tokens": max_new_tokens})
        generated = out["sequences"][:, input_ids.shape[1]:]
        kept = generated != pad  # a sampled pad ends a reply, as the rest of the rows' padding does
        return [(reply[keep], lp[keep]) for reply, lp, keep in zip(generated[:rows], out["log_probs"], kept)]

    def sample_episodes(batch):
        sample_continuously(sampler, batch, gen_kwargs)

    continuous = continuous_turns and sampler.slot_layers_only()
    policy = EpisodePolicy(sample, tokenizer, max_new_tokens=gen_kwargs["max_new_tokens"],
                           stop_ids=list(gen_kwargs["eos_token_id"]), pad_id=pad,
                           sample_episodes=sample_episodes if continuous else None)
    policy.generate_kwargs = gen_kwargs  # what it samples with, as transformers names the options
    return policy
