"""TorchRL's own history-mode policy around a ``ReplySampler``: what ``grpo.inference.reply_policy.ReplyPolicy``
replaced, kept for the tests that compare the two and for ``benchmarks/bench_collection.py``."""

import torch
from torchrl.modules.llm import TransformersWrapper


class SampledLogProbsWrapper(TransformersWrapper):
    """``ReplySampler.generate`` returns the sampled tokens' log-probs where TorchRL expects logits; TorchRL 0.14.1
    also zeroes the first token's log-prob. Both are taken as they come."""

    @classmethod
    def _log_probs_generate(cls, tokens, log_probs, pad_val=-100, pad=True):
        return torch.where(tokens != pad_val, log_probs, 0.0), log_probs


def torchrl_history_policy(sampler, tokenizer, generate_kwargs: dict) -> SampledLogProbsWrapper:
    """The wrapper as the engine built it until 2026-11-27: history in, the env's prompt tokens taken, CPU tensors."""
    wrapper = SampledLogProbsWrapper(
        sampler, tokenizer=tokenizer, input_mode="history", generate=True, return_log_probs=True, pad_output=False,
        # TorchRL refuses top_k=0 ("off"); generate then gets every option as given
        generate_kwargs={k: v for k, v in generate_kwargs.items() if (k, v) != ("top_k", 0)}, prefer_tokens=True)
    wrapper.generate_kwargs.update(generate_kwargs)
    return wrapper
