"""grpo/inference/turn_streaming.py: episodes sampled continuously (a turn joins the decode batch as its answer comes
back) are the episodes sampled by turns when greedy, score as the trainer scores them when sampled, and do not depend
on how fast the environment answers."""

import random
import threading
import time

import pytest
import torch

from grpo.inference import turn_streaming
from grpo.inference.decoding import ReplySampler
from grpo.inference.engine import make_transformers_policy
from grpo.inference.generation import EngineSettings, generate_kwargs
from grpo.inference.prefill import Prefill
from grpo.tasks.envs import make_env
from grpo.tasks.settings import TaskSettings
from grpo.tasks.tool_env import EnvTurn, UserTurnEnv


@pytest.fixture(scope="module")
def tiny(tiny_lm):
    cfg, tok, model, stop_ids = tiny_lm
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=4, num_envs=64, shuffle=False)
    return cfg, tok, model, stop_ids, env.reset()


class VaryingEnv:
    """Answers a turn unless its text's length is a multiple of 3, with a user message whose length follows the
    turn's (so that episodes' turns end at different steps and their contexts differ); takes ``delay`` seconds, at
    random up to it, for each call; ``call_at``: a turn's call ends after this text (None: at a stop token)."""

    def __init__(self, max_turns: int, max_episode_tokens: int, *, background: bool, delay: float = 0.0,
                 call_at: str | None = None):
        self.max_turns, self.max_episode_tokens, self.delay = max_turns, max_episode_tokens, delay
        self.respond_in_background = background
        self.calls, self.threads = 0, set()
        if call_at is not None:
            self.call_end = lambda text: text.index(call_at) + len(call_at) if call_at in text else None

    def answers(self, episode):
        return len(episode.messages[-1]["content"]) % 3 != 0

    def respond(self, episodes):
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        time.sleep(random.uniform(0, self.delay))
        return [EnvTurn({"role": "user", "content": "go on " * (1 + len(e.messages[-1]["content"]) % 4)},
                        {"tool_calls": 1}) for e in episodes]


def sample(tiny, env, *, continuous: bool, greedy: bool, compact_rows: bool, seed: int = 0, max_new_tokens: int = 40):
    cfg, tok, model, stop_ids, reset = tiny
    options = generate_kwargs(EngineSettings.from_config(cfg), tok, greedy=greedy, max_new_tokens=max_new_tokens,
                              stop_ids=stop_ids)
    sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=compact_rows)
    policy = make_transformers_policy(sampler, tok, gen_kwargs=options, continuous_turns=continuous)
    policy.turn_env = env
    torch.manual_seed(seed)
    return policy(reset.copy()), options


def same_episodes(a, b) -> None:
    for key in (("tokens", "response"), ("episode", "sampled_mask"), ("episode", "turns"), ("episode", "truncated"),
                ("episode", "tool_calls")):
        assert all(torch.equal(x, y) for x, y in zip(a.get(key, as_list=True), b.get(key, as_list=True), strict=True)), key
    for x, y in zip(a.get(("log_probs", "response"), as_list=True), b.get(("log_probs", "response"), as_list=True)):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=0)
    assert a["history", "response"].content == b["history", "response"].content


@pytest.fixture(autouse=True)
def join_often(monkeypatch):
    """A check every 2 tokens, and turns join at every one: the tiny model's turns are 5-25 tokens long, so that most
    turns join while others still decode (60 of 67 in the log-prob test's batch)."""
    monkeypatch.setattr(turn_streaming, "STOP_CHECK_EVERY", 2)
    monkeypatch.setattr(turn_streaming, "JOIN_EVERY_CHECKS", 1)


@pytest.mark.parametrize("compact_rows", [False, True])
@pytest.mark.parametrize("call_at", [None, " = "])
def test_greedy_episodes_sampled_continuously_are_those_sampled_by_turns(tiny, compact_rows, call_at):
    """The same turns, cut at the same places (a stop token, the reply cap, the budget, a call's end, which
    continuous sampling stops at as it is written), the same answers: whichever way the turns are batched."""
    by_turns, _ = sample(tiny, VaryingEnv(4, 150, background=False, call_at=call_at), continuous=False, greedy=True,
                         compact_rows=compact_rows)
    continuous, _ = sample(tiny, VaryingEnv(4, 150, background=True, call_at=call_at), continuous=True, greedy=True,
                           compact_rows=compact_rows)
    same_episodes(by_turns, continuous)
    turns = continuous["episode", "turns"]
    assert int(turns.min()) == 1 and int(turns.max()) == 4, "the test needs episodes of one turn and of every turn"
    if call_at is not None:
        history = continuous["history", "response"]
        turns = [m for roles, texts in zip(history.role, history.content) for r, m in zip(roles, texts)
                 if r == "assistant" and call_at.rstrip() in m]
        assert turns and all(m.endswith(call_at.strip()) for m in turns)  # a turn with a call ends at the call


def test_sampled_episodes_score_as_the_trainer_scores_them_and_the_environment_s_tokens_are_masked(tiny, monkeypatch):
    """Each sampled token's log-prob is the trainer's over the whole episode (a turn that joined the batch while
    other rows decoded sees its context exactly: its keys and values placed right, in a batch compacted since, in
    the row its last turn decoded in with only the environment's tokens run through the model, or prefilled whole in
    a free row); the environment's tokens are masked and scored 0."""
    _, tok, model, _, _ = tiny
    joined_while_decoding, join = [], turn_streaming.join
    extended, prefilled = [], []
    extend_rows, into_rows = Prefill.extend_rows, Prefill.into_rows
    monkeypatch.setattr(Prefill, "extend_rows", lambda self, cache, rows, *a, **k: extended.extend(rows)
                        or extend_rows(self, cache, rows, *a, **k))
    monkeypatch.setattr(Prefill, "into_rows", lambda self, *a, **k: prefilled.append(len(a[4]))
                        or into_rows(self, *a, **k))

    def counted(sampler, batch, rows, *args):
        decoding = len(rows.live())
        result = join(sampler, batch, rows, *args)
        joined_while_decoding.extend(result[0] if decoding else [])
        return result

    monkeypatch.setattr(turn_streaming, "join", counted)
    out, options = sample(tiny, VaryingEnv(4, 150, background=True), continuous=True, greedy=False, compact_rows=True)
    assert int(out["episode", "turns"].max()) >= 3 and len(joined_while_decoding) >= 10
    assert len(extended) >= 10 and sum(prefilled) >= 1, (len(extended), sum(prefilled))
    for td in out.unbind(0):
        full, prompt = td["tokens", "full"], td["tokens", "prompt"].numel()
        mask, log_probs = td["episode", "sampled_mask"], td["log_probs", "response"]
        with torch.no_grad():
            logits = model(full[None]).logits[0, prompt - 1:-1] / options["temperature"]
        trainer = torch.log_softmax(logits, -1).gather(-1, full[prompt:, None])[:, 0]
        torch.testing.assert_close(log_probs[mask], trainer[mask], atol=1e-4, rtol=0)
        assert bool((log_probs[~mask] == 0).all()) and td["tokens", "response"].numel() <= 150
        turns = int(td["episode", "turns"])
        assert turns - 1 <= int(td["episode", "tool_calls"]) <= turns  # the last answer may leave no room


def test_a_seeded_batch_samples_the_same_episodes_however_long_the_environment_takes(tiny):
    """Which turn joins the decode batch when does not depend on the tool's speed: answers taken a fixed number of
    checks after their turn ended."""
    runs = [sample(tiny, VaryingEnv(4, 150, background=True, delay=delay), continuous=True, greedy=False,
                   compact_rows=True, seed=3)[0] for delay in (0.0, 0.05)]
    same_episodes(*runs)


def test_a_turn_that_no_longer_fits_in_the_decode_batch_samples_in_the_next(tiny, monkeypatch):
    """With little room left in a decode batch, later turns go on in another one: the same greedy episodes."""
    batches = []
    decode_batch = turn_streaming.decode_batch
    monkeypatch.setattr(turn_streaming, "decode_batch", lambda *a: batches.append(len(a[2])) or decode_batch(*a))
    monkeypatch.setattr(turn_streaming, "stream_steps", lambda batch, cap: cap + 8)
    continuous, _ = sample(tiny, VaryingEnv(3, 120, background=True), continuous=True, greedy=True, compact_rows=False)
    by_turns, _ = sample(tiny, VaryingEnv(3, 120, background=False), continuous=False, greedy=True, compact_rows=False)
    same_episodes(by_turns, continuous)
    assert len(batches) >= 2 and batches[0] == 64


@pytest.mark.parametrize("background", [False, True])
def test_a_user_s_environment_answers_in_the_background_only_when_it_says_it_may(tiny, background):
    """``respond_in_background = True`` on a user's class (``env.turn_env``) lets its calls run in a thread of their
    own; without it they run in the engine's thread, one at a time."""
    user_env = VaryingEnv(4, 150, background=background)
    sample(tiny, UserTurnEnv(user_env, "test_turn_streaming.py:VaryingEnv"), continuous=True, greedy=True,
           compact_rows=False)
    assert user_env.calls and (user_env.threads == {threading.main_thread().name}) != background
