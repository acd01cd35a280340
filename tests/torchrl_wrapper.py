"""TorchRL's own history-mode policy around a ``ReplySampler``: what ``grpo.inference.reply_policy.ReplyPolicy``
replaced, kept for the tests that compare the two and for ``benchmarks/bench_collection.py``."""

import torch
from torchrl.modules.llm import TransformersWrapper


class SampledLogProbsWrapper(TransformersWrapper):
    """``TorchRLGenerate`` hands over the sampled tokens' log-probs where TorchRL expects logits; TorchRL 0.14.1
    also zeroes the first token's log-prob. Both are taken as they come."""

    @classmethod
    def _log_probs_generate(cls, tokens, log_probs, pad_val=-100, pad=True):
        return torch.where(tokens != pad_val, log_probs, 0.0), log_probs


class TorchRLGenerate:
    """A ``ReplySampler`` as TorchRL's wrapper calls it, HF ``generate``'s output: what it reads as ``logits`` (one
    [B] tensor a step) holds the sampled tokens' log-probs (``ReplySampler``'s ``log_probs``, [B, T])."""

    def __init__(self, sampler):
        self.sampler = sampler

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def generate(self, *args, **kwargs):
        out = self.sampler.generate(*args, **kwargs)
        return {"sequences": out["sequences"], "logits": out["log_probs"].T}


def torchrl_history_policy(sampler, tokenizer, generate_kwargs: dict) -> SampledLogProbsWrapper:
    """The wrapper as the engine built it until 2026-11-27: history in, the env's prompt tokens taken, CPU tensors."""
    wrapper = SampledLogProbsWrapper(
        TorchRLGenerate(sampler), tokenizer=tokenizer, input_mode="history", generate=True, return_log_probs=True,
        pad_output=False,
        # TorchRL refuses top_k=0 ("off"); generate then gets every option as given
        generate_kwargs={k: v for k, v in generate_kwargs.items() if (k, v) != ("top_k", 0)}, prefer_tokens=True)
    wrapper.generate_kwargs.update(generate_kwargs)
    return wrapper
