"""The one TorchRL policy of every engine: chat prompts in, whole episodes out, each with its tokens and log-probs.

An episode is up to ``turn_env.max_turns`` assistant turns; between two turns the task's turn environment answers
(``TurnEnv``: a tool's output, a simulated user). A single-turn task has no turn environment: its episode is one
turn, through this same loop. The batch's episodes (``grpo.inference.episodes.EpisodeBatch``) are sampled by turns
(``sample``: each turn samples the episodes still going in one engine call, the turn environment answers all of them
at once, and those that go on sample again) or, where the engine can, continuously (``sample_episodes``: an episode's
next turn joins the decode batch as soon as its answer is back, ``grpo.inference.turn_streaming``).

Token in, token out: an episode's tokens are the prompt's, then each turn's sampled tokens exactly as the engine
returned them (cut after the turn's first stop token, or a code interpreter's call: ``cut_at_call``), then the
environment's turn, rendered by the chat template around its text (``EnvTurnTokens``; or its text alone where it
continues the reply), and so on. Nothing sampled is decoded and re-tokenized. ``sampled_mask`` marks
the sampled tokens: the loss, the KL terms, the entropy and the reply-length statistics read those alone.

An episode ends at the model's final answer (a turn the environment does not answer), at ``max_turns``, when a turn
hits the reply cap, or at the budget of ``max_episode_tokens`` after the prompt; the last three count as truncated.

Writes, as TorchRL's wrappers lay them out (and the envs, rewards, eval and ``grpo.training.replies`` read them):

    history.prompt / .response / .full  ChatHistory: the prompt's messages; the episode's messages (assistant turns,
                                        each without its stop token, and the environment's); the two together
    tokens.prompt / .response / .full   the prompt's tokens; the episode's (sampled and environment's)
    log_probs.response                  the sampler's log-prob of each episode token (0 for the environment's)
    text.response                       the episode as decoded
    episode.sampled_mask                True where the engine sampled the token
    episode.turns / .truncated          assistant turns taken; whether it ended short of a final answer
    episode.tool_calls / .tool_errors / .tool_timeouts / .tool_failures
                                        what the turn environment counted (failures: its own, not the model's)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from tensordict import LazyStackedTensorDict, lazy_stack
from torch.nn.utils.rnn import pad_sequence
import grpo.process.torchrl_import  # noqa: F401 - first: TorchRL's LLM modules imported without vLLM (~3.5 s a process)
from torchrl.data.llm import History
from torchrl.modules.llm.policies.common import ChatHistory

from grpo.inference.episodes import EpisodeBatch, EpisodeState, sample_by_turns
from grpo.tasks.tool_env import EPISODE_COUNTS, TurnEnv


class EnvTurnTokens:
    """An environment's message as tokens: the chat template's text around it (what the template writes after an
    assistant turn, up to the next assistant turn's header) tokenized as template text, and the message's own
    text tokenized with special tokens split: text from a tool or a data row never becomes a special token."""

    ASSISTANT, CONTENT = "\x00assistant turn\x00", "\x00environment text\x00"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @functools.cache  # noqa: B019 - one per role; lives as long as the policy
    def around(self, role: str) -> tuple[list[int], list[int]]:
        """The template's tokens before and after a ``role`` message that follows an assistant turn."""
        messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": self.ASSISTANT},
                    {"role": role, "content": self.CONTENT}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        after = text[text.index(self.ASSISTANT) + len(self.ASSISTANT):]
        before, _, rest = after.partition(self.CONTENT)
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        return encode(before), encode(rest)

    def __call__(self, message: dict, turn: torch.Tensor, inline: bool = False) -> torch.Tensor:
        """``inline``: the message continues the assistant's reply, with no template text around it."""
        content = self.tokenizer.encode(message["content"], add_special_tokens=False, split_special_tokens=True)
        if inline:
            return torch.tensor(content, dtype=torch.long)
        before, after = self.around(message["role"])
        if before and len(turn) and int(turn[-1]) == before[0]:
            before = before[1:]  # the turn ended on the template's end-of-turn token itself (eos): not twice
        return torch.tensor(before + content + after, dtype=torch.long)


class EpisodePolicy(torch.nn.Module):
    """Samples one episode a prompt with ``sample`` (an engine's: prompts' token ids in, each reply's token ids and
    log-probs out, at most ``max_new_tokens`` a turn; ``batch_rows``: the episodes of the batch, of which a later
    turn samples those still going), ``turn_env`` answering between turns (None: one turn); or with
    ``sample_episodes`` (an engine's: an ``EpisodeBatch`` in, every episode sampled to its end), where given.
    Takes a reset's tensordict (batch ``[B]``): its ``history.prompt`` and, where the env wrote them
    (``grpo.tasks.envs.GroupPromptTokens``), the prompts' tokens ``tokens.prompt`` (left-padded with ``pad_id``);
    without them the chat template renders the prompts. Writes the episodes into that tensordict and returns it.

    ``on_sampled``: None, or called with each batch's prompts' and episodes' token ids once its episodes are
    whole (the reference scores them while the CPU goes on: ``grpo.training.reference``)."""

    # what TorchRL's collector reads to know what a step adds (without them it runs the policy once to find out)
    in_keys = [("history", "prompt")]
    out_keys = ["history", "tokens", "log_probs", "text", "episode"]

    def __init__(self, sample: Callable[[list[torch.Tensor], int, int], list[tuple[torch.Tensor, torch.Tensor]]],
                 tokenizer, *, max_new_tokens: int, stop_ids: list[int], pad_id: int, turn_env: TurnEnv | None = None,
                 sample_episodes: Callable[[EpisodeBatch], None] | None = None):
        super().__init__()
        self.sample, self.sample_episodes = sample, sample_episodes
        self.tokenizer, self.max_new_tokens, self.pad_id = tokenizer, max_new_tokens, pad_id
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long)
        self.turn_env, self.on_sampled = turn_env, None
        self.env_seconds = 0.0  # spent waiting on the turn environment (the engine idle meanwhile), so far
        self.env_tokens = EnvTurnTokens(tokenizer)
        # what a turn's last token decodes to, when it is a special stop token (eos): cut from the message's text; a
        # plain one (a tool call's closing tag) is part of what the model wrote
        special = set(tokenizer.all_special_ids)
        self.stop_texts = {i: tokenizer.decode([i]) for i in stop_ids if i in special}

    @torch.no_grad()
    def forward(self, tensordict):
        if tensordict.ndim != 1:
            raise ValueError(f"EpisodePolicy takes a batch of prompts (one batch dimension); got batch size "
                             f"{tuple(tensordict.batch_size)}")
        if not isinstance(tensordict, LazyStackedTensorDict):  # its rows are then the tensordict's own, written below
            tensordict = tensordict.to_lazystack(0)
        history = tensordict.get(("history", "prompt"))
        prompts = self.prompt_tokens(tensordict.get(("tokens", "prompt"), None), history)
        rows = tensordict.get("row_index", None)
        rows = rows.reshape(-1).tolist() if rows is not None else [-1] * len(prompts)
        conversations = prompt_messages(history)
        episodes = self.run_episodes(prompts, conversations, rows)
        if self.on_sampled is not None:
            self.on_sampled(prompts, [e.tokens() for e in episodes])
        def histories(conversations: list[list[dict]]):  # one History a message: ragged rows, lazily stacked
            return lazy_stack([lazy_stack([History(role=m["role"], content=m["content"],
                                                   is_complete=m.get("complete", True)) for m in messages])
                               for messages in conversations])

        tensordict.set("history", ChatHistory(
            prompt=history, response=histories([e.messages for e in episodes]),
            full=histories([prompt + e.messages for prompt, e in zip(conversations, episodes)]),
            batch_size=tensordict.batch_size))
        for row, prompt, episode in zip(tensordict.unbind(0), prompts, episodes):
            tokens = episode.tokens()
            row.set(("tokens", "prompt"), prompt)
            row.set(("tokens", "response"), tokens)
            row.set(("tokens", "full"), torch.cat([prompt, tokens]))
            row.set(("log_probs", "response"), torch.cat(episode.log_probs) if episode.log_probs else torch.zeros(0))
            row.set_non_tensor(("text", "response"), self.tokenizer.decode(tokens, skip_special_tokens=False))
            row.set(("episode", "sampled_mask"), torch.cat(episode.sampled) if episode.sampled
                    else torch.zeros(0, dtype=torch.bool))
            row.set(("episode", "turns"), torch.tensor(episode.turns))
            row.set(("episode", "truncated"), torch.tensor(episode.truncated))
            for name in EPISODE_COUNTS:
                row.set(("episode", name), torch.tensor(episode.counts.get(name, 0)))
        return tensordict

    def run_episodes(self, prompts: list[torch.Tensor], conversations: list[list[dict]],
                     rows: list[int]) -> list[EpisodeState]:
        batch = EpisodeBatch(self, prompts, conversations, rows)
        try:
            if self.sample_episodes is not None and batch.max_turns > 1:  # one turn: nothing would join
                self.sample_episodes(batch)
            else:
                sample_by_turns(self.sample, batch, self.max_new_tokens)
        finally:
            batch.close()
        return batch.episodes

    def cut_at_call(self, reply: torch.Tensor, log_probs: torch.Tensor, stopped: bool, call_end):
        """A turn up to the end of its first call (``call_end`` of its text), where it holds one: what the engine
        sampled after it was written without the call's answer, and is dropped as if the engine had stopped there.
        The cut is the shortest prefix whose text holds the whole call (a search of decodes: no char-to-token map,
        which multi-byte tokens would break). An engine stops a turn within a few tokens of its call's end (ours reads
        the text every ``STOP_CHECK_EVERY`` tokens), so the search gallops back from the end, then halves: about 5
        decodes a turn, not log2 of its length (9 at 300 tokens; these cuts were 0.3 s of a 9.3 s step of the real
        0.5B as a code interpreter, py-spy, one H200)."""
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        holds_call = lambda length: call_end(decode(reply[:length])) is not None  # noqa: E731
        high = reply.numel()
        if not holds_call(high):
            return reply, log_probs, stopped
        back = 8
        while high - back >= 1 and holds_call(high - back):
            high, back = high - back, back * 2
        low = max(high - back + 1, 1)  # holds_call(low - 1) is False, or low is 1
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if holds_call(mid) else (mid + 1, high)
        return reply[:low], log_probs[:low], True

    def message_text(self, reply: torch.Tensor, stopped: bool) -> str:
        """A turn's text as its assistant message holds it: decoded once, without its stop token, stripped."""
        text = self.tokenizer.decode(reply, skip_special_tokens=False)
        return text.removesuffix(self.stop_texts.get(int(reply[-1]), "") if stopped else "").strip()

    def prompt_tokens(self, tokens, history) -> list[torch.Tensor]:
        """Each prompt's token ids, without padding: the env's, else rendered by the chat template."""
        if tokens is None:
            texts = history.apply_chat_template(tokenizer=self.tokenizer, add_generation_prompt=True)
            return [torch.tensor(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        rows = tokens.unbind(0) if isinstance(tokens, torch.Tensor) else tokens
        return [row[row != self.pad_id] for row in rows]


def prompt_messages(history) -> list[list[dict]]:
    """Each prompt's chat history as ``{"role", "content"}`` messages."""
    return [[{"role": r, "content": c} for r, c in zip(roles, texts)] for roles, texts in zip(history.role, history.content)]


def pad_prompts(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts left-padded into one ``[B, P]`` batch, and its attention mask."""
    input_ids = pad_sequence(prompts, batch_first=True, padding_value=pad_id, padding_side="left")
    attention_mask = pad_sequence([torch.ones_like(p) for p in prompts], batch_first=True, padding_side="left")
    return input_ids, attention_mask


class EnginePolicies:
    """What an engine with three ``EpisodePolicy``s (``policy`` samples rollouts, ``greedy_policy`` and
    ``sampled_eval_policy`` evaluate) forwards to them: ``turn_env`` (all answer through it) and ``on_sampled``
    (the rollouts')."""

    @property
    def turn_env(self) -> TurnEnv | None:
        return self.policy.turn_env

    @turn_env.setter
    def turn_env(self, env: TurnEnv | None) -> None:
        self.policy.turn_env = self.greedy_policy.turn_env = self.sampled_eval_policy.turn_env = env

    @property
    def on_sampled(self):
        return self.policy.on_sampled

    @on_sampled.setter
    def on_sampled(self, callback) -> None:
        self.policy.on_sampled = callback
