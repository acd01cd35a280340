"""The episodes of one batch while an engine samples them (``EpisodeBatch``): what it asks of them between the turns
it samples, and the turn environment's answers, in the background where the environment allows it.

An engine drives a batch one of two ways, the same episodes either way:

- by turns (``sample_by_turns``: vLLM's engine, and ours with ``inference_model.continuous_turns=false``): every
  episode's turn k in one call, the environment's answers to all of them at once, then turn k+1;
- continuously (``grpo.inference.turn_streaming``: ours): an episode's turn ends whenever it ends, the environment
  answers while the other episodes go on decoding, and its next turn joins the decode batch then.

``EpisodeBatch.end_turn`` holds what ends a turn and an episode (a stop token, a code interpreter's call, the reply
cap, the episode's token budget, ``env.max_turns``, a final answer); ``EpisodeBatch.answers`` hands the turns the
environment answers to it (one ``respond`` call for those that ended together) and takes back its answers.
"""

from __future__ import annotations

import concurrent.futures
import time

import torch

from grpo.tasks.tool_env import Episode, TurnEnv


def cut_at_stop(reply: torch.Tensor, log_probs: torch.Tensor, stop_ids: torch.Tensor):
    """A turn up to and including its first stop token (whatever an engine appended after it dropped), and whether
    it had one."""
    stops = torch.isin(reply, stop_ids).nonzero()
    if len(stops):
        end = int(stops[0, 0]) + 1
        return reply[:end], log_probs[:end], True
    return reply, log_probs, False


class EpisodeState:
    """One episode while it is sampled: its pieces of tokens, log-probs and sampled marks, its messages, counts."""

    def __init__(self, prompt: torch.Tensor):
        self.prompt, self.pieces, self.log_probs, self.sampled = prompt, [], [], []
        self.messages: list[dict] = []
        self.length, self.turns, self.truncated, self.counts = 0, 0, False, {}

    def context(self) -> torch.Tensor:
        return torch.cat([self.prompt, *self.pieces])

    def tokens(self) -> torch.Tensor:
        return torch.cat(self.pieces) if self.pieces else torch.zeros(0, dtype=torch.long)

    def tokens_of_last_turn(self) -> torch.Tensor:
        return self.pieces[-1]

    def add_turn(self, reply: torch.Tensor, log_probs: torch.Tensor, text: str, stopped: bool) -> None:
        self.pieces.append(reply.long())
        self.log_probs.append(log_probs.float())
        self.sampled.append(torch.ones(reply.numel(), dtype=torch.bool))
        self.messages.append({"role": "assistant", "content": text, "complete": stopped})
        self.length += reply.numel()
        self.turns += 1

    def add_env_turn(self, message: dict, tokens: torch.Tensor) -> None:
        self.pieces.append(tokens)
        self.log_probs.append(torch.zeros(tokens.numel()))
        self.sampled.append(torch.zeros(tokens.numel(), dtype=torch.bool))
        self.messages.append({"role": message["role"], "content": message["content"], "complete": True})
        self.length += tokens.numel()


class EpisodeBatch:
    """The episodes of a batch, one a prompt, as ``policy`` (an ``EpisodePolicy``: its reply cap, stop tokens, turn
    environment and the way it cuts and renders turns) samples them. Episode ``i``'s next turn samples from
    ``context(i)``, at most ``room(i)`` tokens."""

    def __init__(self, policy, prompts: list[torch.Tensor], conversations: list[list[dict]], rows: list[int]):
        self.policy, self.conversations, self.rows = policy, conversations, rows
        self.env: TurnEnv | None = policy.turn_env
        self.max_turns = self.env.max_turns if self.env is not None else 1
        self.budget = self.env.max_episode_tokens if self.env is not None else policy.max_new_tokens
        self.call_end = getattr(self.env, "call_end", None)  # a code interpreter's: where a turn's call ends
        self.episodes = [EpisodeState(prompt) for prompt in prompts]
        self.waiting: list[tuple[int, Episode]] = []  # turns ended that the environment answers, not yet handed to it
        self.asked: list[tuple[int, list, object]] = []  # (when, episodes, their answers or the future of them)
        self.asks = 0
        self.pool = None

    def __len__(self) -> int:
        return len(self.episodes)

    def context(self, i: int) -> torch.Tensor:
        return self.episodes[i].context()

    def room(self, i: int) -> int:
        """The most tokens episode ``i``'s next turn may take: the reply cap, within the episode's budget."""
        return min(self.policy.max_new_tokens, self.budget - self.episodes[i].length)

    def turn_over(self, text: str) -> bool:
        """Whether a turn's text so far holds a whole call (a code interpreter's block), which ends the turn: an
        engine asks to stop decoding it early; ``end_turn`` cuts it where the call ends."""
        return self.call_end is not None and self.call_end(text) is not None

    def end_turn(self, i: int, reply: torch.Tensor, log_probs: torch.Tensor) -> bool:
        """Episode ``i``'s turn as the engine sampled it (it may run past the turn's end: cut here). The episode
        ends, or waits for the environment's answer (``answers``): returns whether it waits."""
        policy, episode = self.policy, self.episodes[i]
        reply, log_probs, stopped = cut_at_stop(reply, log_probs, policy.stop_ids)
        if self.call_end is not None:
            reply, log_probs, stopped = policy.cut_at_call(reply, log_probs, stopped, self.call_end)
        room = self.budget - episode.length
        stopped = stopped and reply.numel() <= room
        reply, log_probs = reply[:room], log_probs[:room]
        episode.add_turn(reply, log_probs, policy.message_text(reply, stopped), stopped)
        if not stopped:  # cut by the reply cap or the budget: a turn cannot go on once cut
            episode.truncated = True
            return False
        as_seen = Episode(self.conversations[i], episode.messages, self.rows[i])
        if self.env is None or not self.env.answers(as_seen):
            return False  # the final answer
        if episode.turns == self.max_turns:
            episode.truncated = True  # the environment would answer, but the turns are spent
            return False
        self.waiting.append((i, as_seen))
        return True

    def answers(self, after: int = 0) -> list[int]:
        """Hands the turns ended since the last call to the environment (one ``respond`` call), and returns the
        episodes whose answers came back, each answer added, that go on (room left to reply in): those handed over
        ``after`` calls ago or before, waiting for them if need be. ``after`` 0: every answer, the environment
        called here; more: called in the background (an environment that allows it: ``respond_in_background``),
        the engine decoding meanwhile."""
        if self.waiting:
            asked, self.waiting = self.waiting, []
            background = after > 0 and getattr(self.env, "respond_in_background", False)
            if background:
                if self.pool is None:
                    self.pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="turn-env")
                answer = self.pool.submit(self.env.respond, [seen for _, seen in asked])
            else:
                answer = self.timed(self.env.respond, [seen for _, seen in asked])
            self.asked.append((self.asks, asked, answer))
        self.asks += 1
        going = []
        while self.asked and self.asked[0][0] <= self.asks - 1 - after:
            _, asked, answer = self.asked.pop(0)
            if isinstance(answer, concurrent.futures.Future):
                answer = self.timed(answer.result)
            going += self.add_answers(asked, answer)
        return going

    def pending(self) -> set[int]:
        """The episodes waiting for the environment's answer."""
        return {i for i, _ in self.waiting} | {i for _, asked, _ in self.asked for i, _ in asked}

    def timed(self, call, *args):
        """``call(*args)``, its seconds counted as the engine's wait on the environment (``env_seconds``)."""
        start = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.policy.env_seconds += time.perf_counter() - start

    def add_answers(self, asked: list[tuple[int, Episode]], env_turns) -> list[int]:
        going = []
        for (i, _), env_turn in zip(asked, env_turns, strict=True):
            episode = self.episodes[i]
            for name, count in env_turn.counts.items():
                episode.counts[name] = episode.counts.get(name, 0) + int(count)
            tokens = self.policy.env_tokens(env_turn.message, episode.tokens_of_last_turn(), env_turn.inline)
            if episode.length + tokens.numel() >= self.budget:  # no room left to answer in
                episode.truncated = True
                continue
            episode.add_env_turn(env_turn.message, tokens)
            going.append(i)
        return going

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None


def sample_by_turns(sample, batch: EpisodeBatch, max_new_tokens: int) -> None:
    """Every episode's turn k in one ``sample`` call (always the whole reply cap, cut to each episode's room after:
    one cap, one set of compiled decode graphs), the environment's answers to all of them, then turn k+1."""
    going = list(range(len(batch)))
    while going:
        replies = sample([batch.context(i) for i in going], max_new_tokens, batch_rows=len(batch))
        for i, (reply, log_probs) in zip(going, replies, strict=True):
            batch.end_turn(i, reply, log_probs)
        going = batch.answers()
