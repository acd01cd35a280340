"""The transformers engine's TorchRL policy: chat prompts in, sampled (or greedy) replies with their log-probs out.

TorchRL's ``TransformersWrapper`` (history mode) does this around one ``generate`` call, but decodes every reply
twice and every prompt once more (once alone, once with its prompt), parses the decoded prompt + reply back into
chat messages with regular expressions, and builds its outputs through per-reply tensorclass bookkeeping: half of a
collection's host time outside the sampler (py-spy, the 1.5B default job on an H100, 128 replies x 512 tokens), on
a CPU the GPU waits for. ``ReplyPolicy`` decodes each reply once and writes the keys the envs, the rewards, eval and
``grpo.rollout.replies.Replies`` read, as TorchRL's wrappers lay them out:

    history.prompt / .response / .full   ChatHistory: the prompt's messages, the reply as one assistant message
                                         (its text without the stop token, stripped; ``is_complete``: it ended on a
                                         stop token), and the two together: the next turn's prompt
    tokens.prompt / .response / .full    one tensor a reply (the prompt without its left padding)
    log_probs.response                   the sampler's log-prob of each reply token
    text.response                        the reply as decoded, its stop token included

A reply is one assistant message whatever it holds, and its text needs no chat-template parsing, so any
template works.
"""

from __future__ import annotations

import torch
from tensordict import LazyStackedTensorDict, lazy_stack
from torch.nn.utils.rnn import pad_sequence
from torchrl.data.llm import History
from torchrl.modules.llm.policies.common import ChatHistory

from grpo.inference.decoding import ReplySampler


class ReplyPolicy(torch.nn.Module):
    """Samples one reply a prompt with ``sampler`` under ``generate_kwargs`` (``grpo.inference.generation.
    generate_kwargs``: the reply cap, stop ids, pad id and sampling options). Takes a reset's tensordict (batch
    ``[B]``): its ``history.prompt`` and, where the env wrote them (``grpo.tasks.envs.GroupPromptTokens``), the
    prompts' tokens ``tokens.prompt`` (left-padded with the pad id); without them the chat template renders the
    prompts. Writes the replies into that tensordict and returns it."""

    # what TorchRL's collector reads to know what a step adds (without them it runs the policy once to find out)
    in_keys = [("history", "prompt")]
    out_keys = ["history", "tokens", "log_probs", "text"]

    def __init__(self, sampler: ReplySampler, tokenizer, generate_kwargs: dict):
        super().__init__()
        self.sampler, self.tokenizer, self.generate_kwargs = sampler, tokenizer, dict(generate_kwargs)
        # what a reply's last token decodes to, when it is a stop token: cut from the message's text
        self.stop_texts = {i: tokenizer.decode([i]) for i in self.generate_kwargs["eos_token_id"]}

    @torch.no_grad()
    def forward(self, tensordict):
        if tensordict.ndim != 1:
            raise ValueError(f"ReplyPolicy takes a batch of prompts (one batch dimension); got batch size "
                             f"{tuple(tensordict.batch_size)}")
        if not isinstance(tensordict, LazyStackedTensorDict):  # its rows are then the tensordict's own, written below
            tensordict = tensordict.to_lazystack(0)
        pad = self.generate_kwargs["pad_token_id"]
        history = tensordict.get(("history", "prompt"))
        prompts = self.prompt_tokens(tensordict.get(("tokens", "prompt"), None), history, pad)
        input_ids = pad_sequence(prompts, batch_first=True, padding_value=pad, padding_side="left")
        attention_mask = pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True, padding_side="left")
        out = self.sampler.generate(input_ids, attention_mask, **self.generate_kwargs)
        generated = out["sequences"][:, input_ids.shape[1]:]
        kept = generated != pad  # TorchRL's wrappers strip the pad id wherever it is (a sampled pad ends a reply)
        replies = [reply[keep] for reply, keep in zip(generated, kept)]
        log_probs = [lp[keep] for lp, keep in zip(out["logits"].T, kept)]
        texts = self.tokenizer.batch_decode(replies, skip_special_tokens=False)
        complete = [len(r) > 0 and int(r[-1]) in self.stop_texts for r in replies]
        contents = [(text.removesuffix(self.stop_texts[int(r[-1])]) if done else text).strip()
                    for text, r, done in zip(texts, replies, complete)]
        response = torch.stack([lazy_stack([History(role="assistant", content=content, is_complete=done)])
                                for content, done in zip(contents, complete)])
        tensordict.set("history", ChatHistory(prompt=history, response=response,
                                              full=history.extend(response, inplace=False, dim=-1),
                                              batch_size=tensordict.batch_size))
        for row, prompt, reply, lp, text in zip(tensordict.unbind(0), prompts, replies, log_probs, texts):
            row.set(("tokens", "prompt"), prompt)
            row.set(("tokens", "response"), reply)
            row.set(("tokens", "full"), torch.cat([prompt, reply]))
            row.set(("log_probs", "response"), lp)
            row.set_non_tensor(("text", "response"), text)
        return tensordict

    def prompt_tokens(self, tokens, history, pad: int) -> list[torch.Tensor]:
        """Each prompt's token ids, without padding: the env's, else rendered by the chat template."""
        if tokens is None:
            texts = history.apply_chat_template(tokenizer=self.tokenizer, add_generation_prompt=True)
            return [torch.tensor(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        rows = tokens.unbind(0) if isinstance(tokens, torch.Tensor) else tokens
        return [row[row != pad] for row in rows]
