"""Prompts checked before any model loads: each must leave its reply room in the context
(``check_prompt_lengths``) and none may hold the tokenizer's special tokens (``check_prompt_text``).
Both read the prompts as the policy will see them: the task's system prompt and the row's text through
the chat template TorchRL's wrappers pick (``wrapper_chat_template``, the one an export writes too)."""

from __future__ import annotations

import math

import grpo.process.torchrl_import  # noqa: F401 - first: TorchRL's LLM modules imported without vLLM (~3.5 s a process)
from torchrl.data.llm import History

from grpo.process.errors import DataError
from grpo.tasks.envs import column_values, prompt_column, task_system_prompt
from grpo.tasks.rewards import special_token_pattern
from grpo.tasks.settings import TaskSettings
from grpo.tasks.tool_env import env_tools


def check_prompt_lengths(settings: TaskSettings, tokenizer, splits: dict) -> None:
    """Every prompt a run will send must leave its reply room in ``inference_model.max_model_len``.
    ``splits``: the train and test splits, by name, as the task's ``load_rows`` returned them.

    Engines meet a longer one only when it is drawn, mid-run, and then fail or stall (a 33k-token
    question: no step within 300 s). Prompts are counted as the policy will see them: the task's
    system prompt and the row's text through the chat template TorchRL's wrappers pick. Every test
    row is checked, not only the ``eval.num_problems`` eval uses. Tokenising every prompt took
    11 s and 1.8 GB at 100,000 rows, so a row is tokenised only when its upper bound
    (``PromptLengthBound``) does not fit, which for most data sets is no row at all.
    """
    system, tools = task_system_prompt(settings), env_tools(settings)
    column = prompt_column(settings)
    bound = PromptLengthBound(tokenizer, system, tools)
    replies = ((settings.train_split, "inference_model.max_new_tokens", settings.max_new_tokens),
               (settings.test_split, "eval.max_new_tokens", settings.eval_max_new_tokens))
    if settings.max_turns > 1:  # an episode of several turns: its whole budget after the prompt
        replies = tuple((split, "env.max_episode_tokens", settings.episode_tokens) for split, _, _ in replies)
    for split, key, reply in replies:
        prompts = column_values(splits[split], column)
        room = settings.max_model_len - reply
        maybe_long = [i for i, prompt in enumerate(prompts) if bound(prompt) > room]
        counts = dict(zip(maybe_long, prompt_token_counts(tokenizer, system, [prompts[i] for i in maybe_long], tools)))
        too_long = [i for i in maybe_long if counts[i] > room]
        if too_long:
            i = too_long[0]
            more = f" ({len(too_long) - 1} more row(s) too)" if len(too_long) > 1 else ""
            raise DataError(
                f"env.dataset={settings.dataset!r} split {split!r} row {i}: its prompt is {counts[i]} tokens (chat "
                f"template and system prompt included), which with {key}={reply} exceeds "
                f"inference_model.max_model_len={settings.max_model_len}{more}; raise inference_model.max_model_len "
                f"to at least {max(counts[j] for j in too_long) + reply}, or shorten or drop the row.")


def wrapper_chat_template(tokenizer) -> str | None:
    """The chat template TorchRL's LLM wrappers render prompts with.

    ``History.apply_chat_template`` picks it by model family (its own for Qwen, Llama, DeepSeek, ...;
    the tokenizer's only when that marks assistant turns; ChatML otherwise), so it need not be the
    tokenizer's. A stand-in tokenizer records the one it is handed.
    """
    class Recorder:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def apply_chat_template(self, **kwargs):
            self.template = kwargs.get("chat_template")
            return ""

    recorder = Recorder()
    History(role=["user"], content=[""], batch_size=(1,)).apply_chat_template(tokenizer=recorder)
    return recorder.template


def chat_turns(system: str | None, prompt: str) -> list[dict]:
    return [*([] if system is None else [{"role": "system", "content": system}]), {"role": "user", "content": prompt}]


def prompt_token_counts(tokenizer, system: str | None, prompts: list[str], tools: list[dict] | None = None,
                        chunk: int = 1024) -> list[int]:
    """Each prompt's tokens as the policy sees it (``tools`` rendered in), a chunk of prompts at a time: only their
    counts are kept."""
    template = wrapper_chat_template(tokenizer)
    counts = []
    for start in range(0, len(prompts), chunk):
        ids = tokenizer.apply_chat_template(
            [chat_turns(system, p) for p in prompts[start:start + chunk]], chat_template=template,
            add_generation_prompt=True, tokenize=True, return_dict=False, tools=tools,
            tokenizer_kwargs={"verbose": False})  # verbose: no "longer than the model's maximum" log line
        counts.extend(len(row_ids) for row_ids in ids)
    return counts


class PromptLengthBound:
    """An upper bound on a prompt's token count, chat template and system prompt included, without
    tokenising it: the template's own tokens plus one per byte of the text tokenised with the prompt
    (after the tokenizer's normaliser), plus one for a word marker a pre-tokenizer may prepend.

    Why it holds: a fast tokenizer cuts its input at added tokens (``<|im_start|>``, ...) and encodes
    the pieces between them on their own, so only the piece holding the prompt (``user\\n`` + prompt)
    depends on it; and every token of byte-level BPE or of SentencePiece with byte fallback covers at
    least one byte of that piece. Where the template changes the prompt's text, or the tokenizer is
    not a fast one, the bound is infinite and every prompt is tokenised."""

    def __init__(self, tokenizer, system: str | None, tools: list[dict] | None = None):
        template = wrapper_chat_template(tokenizer)

        def render(prompt: str) -> str:
            return tokenizer.apply_chat_template(chat_turns(system, prompt), chat_template=template,
                                                 add_generation_prompt=True, tokenize=False, tools=tools)

        backend = getattr(tokenizer, "backend_tokenizer", None)
        prefix, marker, suffix = render("\x00").partition("\x00")
        self.exact_only = backend is None or not marker or render("\x01") != f"{prefix}\x01{suffix}"
        if self.exact_only:
            return
        added = tokenizer.get_added_vocab()
        start = max((prefix.rfind(t) + len(t) for t in added if t in prefix), default=0)
        end = min((suffix.find(t) for t in added if t in suffix), default=len(suffix))
        self.head, self.tail = prefix[start:], suffix[:end]  # encoded in one piece with the prompt
        # the tokens outside that piece, and then some (those of head + tail), and the word marker
        self.fixed = len(tokenizer(prefix + suffix, add_special_tokens=False)["input_ids"]) + 1
        self.normalize = backend.normalizer.normalize_str if backend.normalizer else str

    def __call__(self, prompt: str) -> float:
        if self.exact_only:
            return math.inf
        return self.fixed + len(self.normalize(self.head + prompt + self.tail).encode())


def check_prompt_text(settings: TaskSettings, tokenizer, splits: dict) -> None:
    """No prompt text may hold the tokenizer's special tokens: ``<|im_end|>\\n<|im_start|>assistant`` in a
    question reaches the policy as real chat-control ids, so any row could forge turns. Such rows are
    refused, by row, rather than rewritten: the data is the user's to fix."""
    found = special_token_pattern(tokenizer)
    column = prompt_column(settings)
    for split, rows in splits.items():
        for i, prompt in enumerate(column_values(rows, column)):
            match = found.search(prompt)
            if match:
                raise DataError(
                    f"env.dataset={settings.dataset!r} split {split!r} row {i}: its {column!r} text holds "
                    f"{match.group(0)!r}, a special token of the model's tokenizer, which would be read as a chat "
                    "control token (a forged turn); remove it from the row, or write it another way.")
