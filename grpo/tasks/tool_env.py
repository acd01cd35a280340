"""What answers a model between the turns of an episode: what any such environment is (``TurnEnv``: it sees each
``Episode`` and answers with an ``EnvTurn``; ``grpo.inference.episode_policy`` drives it), the Python tool
(``env.tools: [python]``), or a user's own class (``env.turn_env``), built from the config in one place
(``make_turn_env``).

``PythonToolEnv`` answers a turn that holds a ``<tool_call>``: it parses the call (``grpo.tasks.python_tool``), runs
every episode's code of the batch at once in the sandbox (``grpo.tasks.sandbox``: a slow call is cut at its timeout,
never holding the batch), and returns what the code printed as a ``tool`` message. A malformed call (bad JSON, an
unknown tool, no closing tag, calls past ``tools.max_calls``) is answered with a message saying what was wrong,
never an exception. A turn without a tool call is the final answer.

``PythonCodeBlockEnv`` (``tools.call_format: code_block``) is the same tool as a code interpreter: a turn ends at the
closing fence of its first ```python block (``call_end``), the sandbox runs the block, and its output continues the
same assistant reply as an ```output block (``EnvTurn.inline``), the model writing on after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from grpo.tasks.python_tool import (CALL_CLOSE, PYTHON_TOOL, code_block, code_block_end, holds_call, output_block,
                                    parse_call)
from grpo.tasks.settings import TaskSettings
from grpo.tasks.user_code import call_user, import_object

EPISODE_COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_failures")


@dataclass
class Episode:
    """One episode as the turn environment sees it: the prompt's messages, the episode's so far (the last one the
    assistant turn just sampled), and the data row it came from."""
    prompt: list[dict]
    messages: list[dict]
    row_index: int


@dataclass
class EnvTurn:
    """The environment's answer to a turn: one message (``role``, ``content``), rendered by the chat template, and
    what it counts (``EPISODE_COUNTS`` names: a tool call, an error, a timeout, a failure of the tool itself).
    ``inline``: the content continues the assistant's reply as it is, no template turn around it."""
    message: dict
    counts: dict = field(default_factory=dict)
    inline: bool = False


class TurnEnv(Protocol):
    """What answers a model between turns (``PythonToolEnv``, or a user's own class)."""

    max_turns: int           # assistant turns an episode may take
    max_episode_tokens: int  # tokens after the prompt an episode may hold, the environment's included

    def answers(self, episode: Episode) -> bool:
        """Whether it answers the turn just sampled (no: that turn was the final answer). No side effects."""

    def respond(self, episodes: list[Episode]) -> list[EnvTurn]:
        """Its answers to the turns it answers, in order, all at once (a tool runs them concurrently)."""

    # Optional: ``call_end(text) -> int | None``, where a turn's text is cut, its call whole (a code interpreter's
    # ```python block: ``PythonCodeBlockEnv``); without it a turn ends at a stop token only. And
    # ``respond_in_background = True``: ``respond`` may run in a thread of its own while the engine decodes, several
    # calls at once (without it, each call runs in the engine's thread, between two of its decode steps).


NO_OUTPUT = "[no output: print() what you want to see]"


class PythonToolEnv:
    """The Python tool between turns: up to ``max_calls`` calls an episode, run in ``sandbox``."""

    respond_in_background = True  # the sandbox hands each call a uid of its own, at most ``workers`` at once

    def __init__(self, sandbox, *, max_turns: int, max_episode_tokens: int, max_calls: int):
        self.sandbox, self.max_turns, self.max_episode_tokens, self.max_calls = sandbox, max_turns, max_episode_tokens, max_calls

    def answers(self, episode: Episode) -> bool:
        return holds_call(episode.messages[-1]["content"])

    def call_code(self, text: str) -> tuple[str | None, str | None]:
        """A turn's call: ``(code, None)``, or ``(None, why it is malformed)``."""
        return parse_call(text)

    def answer(self, text: str, counts: dict) -> EnvTurn:
        return EnvTurn(tool_message(text), counts)

    def respond(self, episodes: list[Episode]) -> list[EnvTurn]:
        answers: list[EnvTurn | None] = []
        to_run = []  # (episode's place, code)
        for i, episode in enumerate(episodes):
            calls = 1 + sum(message["role"] == "tool" for message in episode.messages)
            code, error = self.call_code(episode.messages[-1]["content"])
            if error is None and calls > self.max_calls:
                error = f"no more tool calls: this episode has used its {self.max_calls}; give your final answer"
            if error is not None:
                answers.append(self.answer(f"Error: {error}", {"tool_calls": 1, "tool_errors": 1}))
            else:
                answers.append(None)
                to_run.append((i, code))
        for (i, _), run in zip(to_run, self.sandbox.run_many([code for _, code in to_run]), strict=True):
            if run.failed is not None:  # the sandbox's failure, not the model's: its episode leaves the statistics
                answers[i] = self.answer(f"Error: the tool could not run ({run.failed})",
                                         {"tool_calls": 1, "tool_failures": 1})
                continue
            counts = {"tool_calls": 1, "tool_timeouts": int(run.timed_out),
                      "tool_errors": int(run.timed_out or run.exit_code != 0)}
            answers[i] = self.answer(run.output or NO_OUTPUT, counts)
        return answers


class PythonCodeBlockEnv(PythonToolEnv):
    """The Python tool as a code interpreter: the first ```python block of a turn runs, and what it printed follows
    in the same reply as an ```output block."""

    def call_end(self, text: str) -> int | None:
        """Where a turn's text is cut: after its first complete ```python block (None: it holds none)."""
        return code_block_end(text)

    def answers(self, episode: Episode) -> bool:
        return code_block(episode.messages[-1]["content"]) is not None

    def call_code(self, text: str) -> tuple[str | None, str | None]:
        return code_block(text), None

    def answer(self, text: str, counts: dict) -> EnvTurn:
        return EnvTurn(tool_message(output_block(text)), counts, inline=True)


class UserTurnEnv:
    """A user's ``env.turn_env`` instance, each call of it through ``call_user``: what leaves it is one line naming
    the class and the method."""

    def __init__(self, env, spec: str):
        self.env, self.spec = env, spec
        self.respond_in_background = getattr(env, "respond_in_background", False) is True  # optional (TurnEnv)
        if hasattr(env, "call_end"):  # optional (TurnEnv): where a turn is cut, its call whole
            self.call_end = lambda text: call_user(f"env.turn_env={spec!r}: its call_end()", env.call_end, text)

    max_turns = property(lambda self: self.env.max_turns)
    max_episode_tokens = property(lambda self: self.env.max_episode_tokens)

    def answers(self, episode: Episode) -> bool:
        return call_user(f"env.turn_env={self.spec!r}: its answers()", self.env.answers, episode)

    def respond(self, episodes: list[Episode]) -> list[EnvTurn]:
        return call_user(f"env.turn_env={self.spec!r}: its respond()", self.env.respond, episodes)


def tool_message(text: str) -> dict:
    return {"role": "tool", "content": text}


def make_turn_env(settings: TaskSettings, tokenizer) -> TurnEnv | None:
    """What answers between turns: the tools ``env.tools`` names, a user's ``env.turn_env`` class, or None (an
    episode is one turn). The sandbox's protections are printed once."""
    budget = settings.episode_tokens
    if settings.turn_env:
        env_class, spec = import_object(settings.turn_env, "env.turn_env"), settings.turn_env
        return UserTurnEnv(call_user(f"env.turn_env={spec!r}: its constructor", env_class,
                                     max_turns=settings.max_turns, max_episode_tokens=budget), spec)
    if settings.python_tool:
        from grpo.tasks.sandbox import Sandbox, SandboxSettings  # only where a tool runs

        s = settings
        sandbox = Sandbox(SandboxSettings(timeout_s=s.tool_timeout_s, cpu_s=s.tool_cpu_s, memory_mb=s.tool_memory_mb,
                                          file_size_mb=s.tool_file_size_mb, processes=s.tool_processes,
                                          output_chars=s.tool_output_chars, workers=s.tool_workers))
        print(sandbox.describe(), flush=True)
        env_class = PythonToolEnv if s.tool_call_tags else PythonCodeBlockEnv
        return env_class(sandbox, max_turns=s.max_turns, max_episode_tokens=budget, max_calls=s.tool_max_calls)
    return None


def env_tools(settings: TaskSettings) -> list[dict] | None:
    """The tools the chat template renders into every prompt (None: none; a code interpreter's prompt says how)."""
    return [PYTHON_TOOL] if settings.tool_call_tags else None


def turn_stop_ids(settings: TaskSettings, tokenizer, model_stop_ids: list[int]) -> list[int]:
    """Every id that ends an assistant turn: the model's own (``model_stop_ids``) and, with the Python tool, a call's
    closing tag where the tokenizer holds it as one token (Qwen2.5 does): the model never writes the tool's answer."""
    ids = tokenizer.encode(CALL_CLOSE, add_special_tokens=False) if settings.tool_call_tags else []
    return sorted({*model_stop_ids, *(ids if len(ids) == 1 else [])})


