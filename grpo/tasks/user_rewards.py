"""Reward functions from the user's code: ``reward.functions`` weighted by ``reward.weights``.

    reward.functions=[my_pkg.rewards:score,path/to/checks.py:brevity] reward.weights=[1.0,0.1]

An entry is ``module.path:function`` (imported from the working directory, the repo root or
PYTHONPATH) or ``path/to/file.py:function`` (relative to the working directory, else to the
repo root). Async rollout workers import them the same way: a local Ray worker starts in the
trainer's working directory with its PYTHONPATH; on a Ray cluster every node needs the code.

How a function is called
------------------------
Once per reply, with keyword arguments, of which it gets those it names::

    def score(prompt: str, reply: str, answer: str) -> float: ...

- ``prompt``: the row's prompt text as the user turn holds it, without system prompt or chat
  template (the ``env.prompt_key`` column; GSM8K's ``question``, IFEval's ``prompt``);
- ``reply``: the model's reply (an episode's last assistant turn: its final answer), trailing special tokens
  (``<|im_end|>``, eos, padding) removed;
- ``episode`` (only to a function that names it): the whole episode after the prompt, a list of ``{"role",
  "content"}`` messages: the assistant's turns and, between them, the environment's (``tool`` messages: what the
  Python tool printed); one message for a single-turn task;
- ``answer``: the ``env.answer_key`` column, when that is set (generic task);
- every column of the row under its own name; ``**row`` takes them all.

``prompt``, ``reply`` and ``answer`` win over columns of the same name. It returns one number
(a float; an int or a bool counts), finite. Batched form: a function with ``batched = True``
(``score.batched = True`` after its ``def``) is called once per batch of replies, each keyword
a list with one entry per reply in the same order, and returns one number per reply (a list,
tuple, numpy array or 1-d tensor of that length).

How they combine
----------------
``sum(weights[i] * functions[i](...))`` (``reward.weights`` empty: 1.0 each). For
``env.task=generic`` that sum is the reward, and a reply succeeds (``eval/accuracy``) when it is
above ``reward.success_threshold``. For gsm8k and ifeval it is added to the task's own reward;
their ``success`` stays the task's own (a right answer, all instructions followed).

What stops a run
----------------
At start, one ``ConfigError`` naming the entry and the fix: a module or file that does not
import, a function it does not define, a parameter that is none of prompt, reply, answer or a
column (and has no default), or a function that never sees the reply. At the first call that
makes one: a return value that is not a number, is NaN or infinite, or (batched) a list of the
wrong length; a call that takes longer than ``reward.timeout_s`` (a ``RewardTimeout`` naming the
function and the row). Whatever the function raises, ``sys.exit`` included, is a ``UserCodeError``:
one line naming the function and the row, below the function's own frames (``call_user``).

Where it runs
-------------
In a thread of its own, one per function and batch of replies, while the env waits for each call's
result (so ``signal.alarm`` and thread-local settings inside a function do not work). The seconds
spent in them are each step's ``reward_s`` in metrics.jsonl.
"""

from __future__ import annotations

import inspect
import math
import numbers
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tensordict import NonTensorData, TensorDictBase
import grpo.process.torchrl_import  # noqa: F401 - first: TorchRL's LLM modules imported without vLLM (~3.5 s a process)
from torchrl.data import Composite, Unbounded
from torchrl.envs import Compose, Transform

from grpo.process.errors import ConfigError, RewardTimeout
from grpo.process.setup import raise_if_stop_signalled
from grpo.tasks.rewards import special_tokens, strip_trailing_special_tokens
from grpo.tasks.settings import parse_spec
from grpo.tasks.user_code import call_user, import_object

FIXED_ARGUMENTS = ("prompt", "reply", "episode")  # every call offers these; "answer" too when env.answer_key is set


@dataclass(frozen=True)
class RewardFunction:
    """One ``reward.functions`` entry, imported and its signature read."""

    key: str  # "reward.functions[i]='spec'": how messages name it
    fn: Callable
    batched: bool
    names: frozenset[str]  # keyword parameters it takes
    required: frozenset[str]  # those without a default
    takes_all: bool  # has **kwargs: gets every argument

    def check_arguments(self, offered: Sequence[str], where: str) -> None:
        """Stop at start when a parameter it needs is not among ``offered`` (fixed ones and columns)."""
        unknown = sorted(self.required - set(offered))
        if unknown:
            raise ConfigError(
                f"{self.key}: {self.fn.__name__}{inspect.signature(self.fn)} needs {unknown}, which "
                f"{'is' if len(unknown) == 1 else 'are'} none of the arguments {where} offers ({', '.join(offered)}); "
                "rename the parameter to one of them, give it a default, or take **row.")

    def __call__(self, arguments: list[dict], row_indices: list[int], where: str, timeout_s: float) -> list[float]:
        """One number per reply; ``arguments[j]`` is everything offered for reply ``j``. A call taking over
        ``timeout_s`` seconds raises RewardTimeout."""
        # **row takes the row's columns, prompt and reply; the episode goes to a function that names it
        passed = [{k: v for k, v in a.items() if k in self.names or (self.takes_all and k != "episode")}
                  for a in arguments]
        if not self.batched:
            values = self._calls([(f"row {row}", kw) for kw, row in zip(passed, row_indices)], where, timeout_s)
            return [self._number(value, row, where) for value, row in zip(values, row_indices)]
        columns = {k: [kw[k] for kw in passed] for k in passed[0]}
        (result,) = self._calls([(f"a batch of rows {sorted(set(row_indices))}", columns)], where, timeout_s)
        values = result.tolist() if isinstance(result, torch.Tensor) or hasattr(result, "dtype") else result
        if not isinstance(values, (list, tuple)) or len(values) != len(passed):
            shown = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"{_short(result)}"
            raise ConfigError(f"{self.key} is batched and returned {shown} for a batch of {len(passed)} replies "
                              f"({where}); return one number per reply, in the order of the reply list.")
        return [self._number(v, row, where) for v, row in zip(values, row_indices)]

    def _calls(self, calls: list[tuple[str, dict]], where: str, timeout_s: float) -> list:
        """The results of ``calls`` ((rows, keyword arguments) each), made one after another in a daemon thread
        while this thread waits at most ``timeout_s`` for each.

        Python cannot stop a thread, nor interrupt a call from outside it, and SIGALRM reaches only the main
        thread, while async rollout workers score in one of Ray's. So the call runs elsewhere and this thread
        gives up on it: a hung call is left behind (a daemon thread does not hold up the process's exit) and
        the run ends with RewardTimeout; a signal meanwhile is handled at once. A call that holds the GIL
        (a C loop) stops this thread too; only a separate process could bound that, at a pickling cost per call.
        """
        results: queue.SimpleQueue = queue.SimpleQueue()

        def make_calls():
            for rows, kwargs in calls:
                try:
                    results.put((True, self._call(rows, **kwargs)))
                except BaseException as err:  # noqa: BLE001 - raised by the waiting thread
                    results.put((False, err))
                    return

        threading.Thread(target=make_calls, name=f"reward function {self.fn.__name__}", daemon=True).start()
        values = []
        for rows, _ in calls:
            deadline = time.monotonic() + timeout_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    returned, value = results.get(timeout=min(left, 0.5))
                    break
                except queue.Empty:
                    raise_if_stop_signalled(f"{self.key} on {rows}")
            else:
                raise RewardTimeout(f"{self.key} took longer than reward.timeout_s={timeout_s:g} s on {rows} ({where}) "
                                    "and was abandoned; make it return sooner (does it wait on a lock, a server, "
                                    "input?), or raise reward.timeout_s if it is only slow.")
            if not returned:
                raise value
            values.append(value)
        return values

    def _call(self, rows: str, /, **kwargs):  # positional only: a column may be named rows
        return call_user(f"{self.key} on {rows}", self.fn, **kwargs)

    def _number(self, value, row: int, where: str) -> float:
        if not isinstance(value, (numbers.Real, np.bool_)):
            raise ConfigError(f"{self.key} returned {_short(value)} for a reply to row {row} ({where}); it must "
                              "return a number (a float) per reply, e.g. 1.0 for a good reply and 0.0 for a bad one.")
        try:
            finite, shown = math.isfinite(value), value if isinstance(value, float) else _short(value)
        except OverflowError:  # an int past float's range (10**400)
            finite, shown = False, f"{_short(value)}, past a float's range,"
        if not finite:
            raise ConfigError(f"{self.key} returned {shown} for a reply to row {row} ({where}); return a finite "
                              "number, e.g. 0.0 for a reply it cannot score.")
        return float(value)


def _short(value) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python prints
        text = f"an int of {value.bit_length()} bits"
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def load_reward_function(spec: str, index: int) -> RewardFunction:
    """Import ``reward.functions[index]`` and read its signature; every problem is a ConfigError."""
    key, where, name = parse_spec(spec, index)
    fn = import_object(spec, key)
    if not callable(fn):
        raise ConfigError(f"{key}: {name} is a {type(fn).__name__}, not a function.")
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{key}: its signature cannot be read ({err}); wrap it in a def.") from err
    kinds = inspect.Parameter
    positional_only = [p.name for p in parameters if p.kind is kinds.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only:
        raise ConfigError(f"{key}: {name}{inspect.signature(fn)} takes {positional_only} positionally only; "
                          "arguments are passed by name: drop the '/'.")
    by_name = [p for p in parameters if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)]
    names = frozenset(p.name for p in by_name)
    takes_all = any(p.kind is kinds.VAR_KEYWORD for p in parameters)
    if not {"reply", "episode"} & names and not takes_all:
        raise ConfigError(f"{key}: {name}{inspect.signature(fn)} never sees the reply it should score; define it "
                          f"as def {name}(prompt, reply, **row) -> float (or name the columns it needs besides reply).")
    return RewardFunction(key=key, fn=fn, batched=bool(getattr(fn, "batched", False)), names=names,
                          required=frozenset(p.name for p in by_name if p.default is p.empty), takes_all=takes_all)


def load_reward_functions(specs) -> list[RewardFunction]:
    return [load_reward_function(spec, i) for i, spec in enumerate(specs)]


def offered_arguments(columns: Sequence[str], answer_key: str | None) -> list[str]:
    """What a reward function may name: the fixed arguments, then the columns."""
    fixed = [*FIXED_ARGUMENTS, *(["answer"] if answer_key else [])]
    return fixed + [c for c in columns if c not in fixed]


class UserRewards(Transform):
    """Scores each reply with the user's reward functions (see the module docstring).

    ``rows``: the split the env draws from (what its ``row_index`` points into); ``prompt_key``
    and ``answer_key``: the columns offered as ``prompt`` and ``answer``. ``sole``: the functions
    are the whole reward (generic task), and ``success`` is ``reward > success_threshold``;
    otherwise their sum is added to the reward the task's own transform wrote before.
    """

    def __init__(self, functions: list[RewardFunction], weights: Sequence[float], rows, *, prompt_key: str,
                 answer_key: str | None, split: str, tokenizer, sole: bool, timeout_s: float,
                 success_threshold: float = 0.0):
        super().__init__(in_keys=[], out_keys=["reward", *(["success"] if sole else [])])
        self.functions, self.weights = functions, [float(w) for w in weights] or [1.0] * len(functions)
        self.rows, self.prompt_key, self.answer_key = rows, prompt_key, answer_key
        self.where = f"split {split!r}"
        self.sole, self.success_threshold, self.timeout_s = sole, success_threshold, timeout_s
        self.specials = special_tokens(tokenizer)
        self.seconds = 0.0  # spent in the functions since take_reward_seconds last read it

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if next_tensordict.batch_dims > 1:
            with tensordict.view(-1) as td_view, next_tensordict.view(-1) as next_view:
                self._step(td_view, next_view)
            return next_tensordict
        row_indices = tensordict["row_index"].reshape(-1).tolist()
        arguments = []
        replies = self._replies(tensordict)
        for row_index, reply, episode in zip(row_indices, replies, self._episodes(tensordict, replies), strict=True):
            row = self.rows[row_index]
            fixed = {"prompt": row[self.prompt_key], "reply": reply, "episode": episode}
            if self.answer_key:
                fixed["answer"] = row[self.answer_key]
            arguments.append({**row, **fixed})
        total = torch.zeros(len(arguments), dtype=torch.float64)
        t0 = time.perf_counter()
        for function, weight in zip(self.functions, self.weights, strict=True):
            total += weight * torch.tensor(function(arguments, row_indices, self.where, self.timeout_s),
                                           dtype=torch.float64)
        self.seconds += time.perf_counter() - t0
        shape = next_tensordict.batch_size + (1, 1)
        reward = total.to(torch.get_default_dtype()).view(shape)
        if self.sole:
            next_tensordict.set("success", reward > self.success_threshold)
        else:
            reward = reward + next_tensordict.get("reward").view(shape)
        next_tensordict.set("reward", reward)
        return next_tensordict

    def _replies(self, tensordict: TensorDictBase) -> list[str]:
        """The last message of each env's history (the reply), without trailing special tokens."""
        full = tensordict.get(("history", "full"))
        texts = []
        for i in range(tensordict.batch_size[0]):
            content = full[i][-1].content
            text = content.data if isinstance(content, NonTensorData) else content
            texts.append(strip_trailing_special_tokens(text or "", self.specials))
        return texts

    @staticmethod
    def _episodes(tensordict: TensorDictBase, replies: list[str]) -> list[list[dict]]:
        """Each env's episode after its prompt, as messages (a policy that wrote no response history: the reply)."""
        response = tensordict.get(("history", "response"), None)
        if response is None:
            return [[{"role": "assistant", "content": reply}] for reply in replies]
        return [[{"role": role, "content": content} for role, content in zip(response[i].role, response[i].content)]
                for i in range(tensordict.batch_size[0])]

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        if self.sole:  # otherwise the task's reward transform declared reward already
            shape = reward_spec.shape + (1, 1)
            reward_spec.update(Composite(reward=Unbounded(shape, dtype=torch.get_default_dtype()),
                                         success=Unbounded(shape, dtype=torch.bool), shape=reward_spec.shape))
        return reward_spec


def take_reward_seconds(env) -> float:
    """The seconds ``env``'s reward functions took since the last call (0.0 without any): a step's ``reward_s``."""
    transforms = env.transform if isinstance(env.transform, Compose) else [env.transform]
    seconds = 0.0
    for rewards in (t for t in transforms if isinstance(t, UserRewards)):
        seconds, rewards.seconds = seconds + rewards.seconds, 0.0
    return seconds
