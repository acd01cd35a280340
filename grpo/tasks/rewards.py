"""GSM8K rewards: correctness of the final number, plus an optional format reward (off by default).

TorchRL's ``GSM8KRewardParser`` compares the text inside ``<answer>`` with the
reference by string equality after light normalisation, so "$1,200.00" vs "1200" or
"The answer is 8." vs "8" count as wrong. We keep its env plumbing and replace the scoring
with a numeric comparison of the final number, read where real instruct models write it.

Where the predicted answer is read is ``reward.answer_extraction`` (lm-eval-harness scores GSM8K
with a strict and a flexible match the same way):

- ``strict``: an explicit final answer: the last of ``\boxed{N}``, ``#### N``, "The (final) answer
  is N" / "Final answer: N" and ``<answer>N</answer>`` in the reply that holds a number;
- ``flexible`` (the default): the strict answer, else the last number anywhere in the reply;
- ``tag``: the text inside ``<answer>`` only (the R1-style tag recipe).

Every reply is also scored both strict and flexible (``correct_strict``, ``correct_flexible``,
``marked_answer``), whatever pays the reward, so eval reports them side by side.

``is_well_formatted`` is the format rule of every task (IFEval's ``format_ok`` is this rule too).
"""

from __future__ import annotations

import math
import re

import torch
from tensordict import TensorDict
import grpo.process.torchrl_import  # noqa: F401 - first: TorchRL's LLM modules imported without vLLM (~3.5 s a process)
from torchrl.data import Unbounded
from torchrl.envs.llm import GSM8KRewardParser

from grpo.tasks.settings import ANSWER_EXTRACTIONS

_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\$?\s*\.\d+")
_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def parse_number(text: str) -> float | None:
    """The last number in ``text``, tolerant of ``$``, thousands commas, signs, decimals and a trailing dot."""
    matches = _NUMBER.findall(text.replace("\u2212", "-"))
    if not matches:
        return None
    token = matches[-1].replace("$", "").replace(",", "").replace(" ", "")
    try:
        value = float(token)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def reference_answer(answer_field: str) -> str:
    """The final answer of a GSM8K ``answer`` field (the text after ``####``)."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer lacks the '#### N' final line: {answer_field[-80:]!r}")
    return answer_field.rsplit("####", 1)[1].strip()


def numbers_match(predicted: str, reference: str) -> bool:
    want, got = parse_number(reference), parse_number(predicted)
    return want is not None and got is not None and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-9)


def is_well_formatted(response: str) -> bool:
    """``<think>…</think>`` then ``<answer>…</answer>``, with only whitespace around them: the format
    rule of both tasks. The blocks' contents are not checked (a repeated block still passes)."""
    return _FORMAT.fullmatch(response) is not None


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# What instruct models write for a final answer, and how far into the marked text its number may start
# ("The answer is unclear; maybe 8" marks nothing; "The answer is: **$8**" marks 8).
_FINAL_ANSWER_MARKS = (
    (re.compile(r"\\boxed\s*\{((?:[^{}]|\{[^{}]*\})*)\}"), None),        # \boxed{18}, \boxed{\$1{,}200}
    (re.compile(r"####([^\n]*)"), 4),                                     # #### 18
    (re.compile(r"answer\s*(?:is|:)([^\n]*)", re.IGNORECASE), 12),         # The answer is 18. / Final answer: $18
    (_ANSWER_TAG, None),                                                   # <answer>18</answer>
)


def _numbers_text(text: str) -> str:
    """``text`` with a unicode minus as ``-`` and LaTeX's ``{,}`` thousands separator as ``,``."""
    return text.replace("\u2212", "-").replace("{,}", ",")


def marked_answer(text: str) -> str | None:
    """The number of the reply's last explicit final answer (see the module docstring), or None."""
    found = []  # (position, number)
    for mark, max_offset in _FINAL_ANSWER_MARKS:
        for match in mark.finditer(text):
            number = _NUMBER.search(_numbers_text(match.group(1)))
            if number is not None and (max_offset is None or number.start() <= max_offset):
                found.append((match.start(), number.group(0).strip()))
    return max(found)[1] if found else None


_NUMBER_RUN = re.compile(r"[\d\s,.$-]*")  # the characters a _NUMBER match is made of
_DIGIT = re.compile(r"\d")


def last_number(text: str) -> str | None:
    """The reply's last number, as the last of ``_NUMBER.findall`` over it. Read from the end: the last digit, the
    run of number characters around it (no match spans another character), and the numbers in that run alone.
    Matching the whole reply took 17% of a collection's host time outside the sampler (py-spy, 1.5B default job on
    an H100, random-init replies)."""
    text = _numbers_text(text)
    backwards = text[::-1]
    digit = _DIGIT.search(backwards)
    if digit is None:
        return None
    last = len(text) - 1 - digit.start()
    run_start = len(text) - _NUMBER_RUN.match(backwards, digit.start()).end()
    numbers = _NUMBER.findall(text, run_start, _NUMBER_RUN.match(text, last).end())
    return numbers[-1].strip()


# Always treated as special, whatever the tokenizer says (TorchRL's chat parsing knows them too).
_CHATML_SPECIALS = ("<|im_end|>", "<|endoftext|>")


def special_tokens(tokenizer) -> tuple[str, ...]:
    """The tokenizer's special tokens (eos, pad, chat markers, ...), longest first.

    Added tokens that are not special (such as ``<think>`` or ``<answer>`` in our tiny model's
    vocabulary) are left out: they are reply text.
    """
    tokens = set(_CHATML_SPECIALS)
    if tokenizer is not None:
        tokens.update(getattr(tokenizer, "all_special_tokens", ()) or ())
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        tokens.update(t.content for t in decoder.values() if getattr(t, "special", False))
    return tuple(sorted((t for t in tokens if t), key=len, reverse=True))


def special_token_pattern(tokenizer) -> re.Pattern:
    """A regex matching any of ``special_tokens(tokenizer)``, the longest first."""
    return re.compile("|".join(map(re.escape, special_tokens(tokenizer))))


def strip_trailing_special_tokens(text: str, specials: tuple[str, ...]) -> str:
    """``text`` without the special tokens (and whitespace) at its end, e.g. ``<|im_end|><|endoftext|>``."""
    while True:
        stripped = text.rstrip()
        for token in specials:
            stripped = stripped.removesuffix(token)
        if stripped == text:
            return text
        text = stripped


class GSM8KReward(GSM8KRewardParser):
    """TorchRL's GSM8K reward transform with numeric answer matching.

    ``reward = correct_reward * [final number right] + format_reward * [well formatted]``;
    ``success`` is correctness alone (it is what eval accuracy averages). Where the predicted answer
    is read is ``answer_extraction`` (``flexible``, ``strict`` or ``tag``: the module docstring);
    ``reward_answer`` is 1 when it found one (``tag``: a non-empty ``<answer>``).

    Outputs beside the reward, whatever ``answer_extraction`` is: ``correct_strict`` and
    ``correct_flexible`` (the answer read strict / flexible is right) and ``marked_answer`` (the reply
    has an explicit final answer): a collapse to tags, or to bare numbers, shows in eval.

    The format reward is the strict ``<think>…</think><answer>…</answer>`` layout in every mode.
    Special tokens of the tokenizer never count: trailing ones (``<|im_end|>``, ``<|endoftext|>``,
    padding) are stripped before the format check, and all of them are blanked out before a
    number is searched in the reply text.
    """

    def __init__(self, tokenizer, *, correct_reward: float = 1.0, format_reward: float = 0.0,
                 answer_extraction: str = "flexible"):
        if answer_extraction not in ANSWER_EXTRACTIONS:
            raise ValueError(
                f"reward.answer_extraction={answer_extraction!r} is unknown; use 'flexible' (an explicit final answer, "
                "else the last number), 'strict' (an explicit final answer only) or 'tag' (inside <answer> only)."
            )
        super().__init__(tokenizer=tokenizer, correct_reward=correct_reward, format_reward=format_reward)
        self.answer_extraction = answer_extraction
        self._specials = special_tokens(tokenizer)
        self._special_re = special_token_pattern(tokenizer)

    def transform_reward_spec(self, reward_spec):
        reward_spec = super().transform_reward_spec(reward_spec)
        shape = reward_spec.shape + (1, 1)
        for key in ("correct_strict", "correct_flexible", "marked_answer"):
            reward_spec[key] = Unbounded(shape, dtype=torch.bool)
        return reward_spec

    def extract_tags(self, text: str):
        # both steps hand what this returns second to the scoring as its text: the whole reply, trailing special
        # tokens stripped, where the answer is read every way and the format checked
        text = strip_trailing_special_tokens(text, self._specials)
        return GSM8KRewardParser.extract_tags(text)[0], text

    def _step(self, tensordict, next_tensordict):
        """TorchRL's step, its scores built as one tensor a key: the parent builds a TensorDict a reply and stacks
        them, ~40 ms of each 256-reply batch on CPU (0.16 s of the 0.5B default step's host time with the reading:
        py-spy, H200). The same keys, values and ``[B, 1, 1]`` shapes; other input modes and shapes: the parent."""
        if next_tensordict.batch_dims != 1 or self.input_mode != "history":
            return super()._step(tensordict, next_tensordict)
        self._maybe_get_in_keys()
        contents = tensordict.get(self.in_keys[0]).content  # each row's messages' texts
        replies = [messages[-1] for messages in (contents.tolist() if hasattr(contents, "tolist") else contents)]
        rows = []
        for reply, answer in zip(replies, next_tensordict[self.in_keys[1]], strict=True):
            cot, text = self.extract_tags(reply)  # strips eos and <|im_end|>, as the parent does before it, and more
            rows.append(self.score(reference_answer(answer), text, cot))
        scores = {key: torch.tensor([row[key] for row in rows]).view(-1, 1, 1) for key in rows[0]} if rows else {}
        for key, value in scores.items():
            before = next_tensordict.get(key, None)  # another transform's, added to, as the parent does
            next_tensordict.set(key, value if before is None else value + before)
        answered = scores.get("reward_answer")
        if self.set_done_if_answer and answered is not None and bool((answered > 0).any()):
            for key in ("done", "terminated"):
                flag = next_tensordict.get(key, None)
                if flag is not None:
                    next_tensordict.set(key, (answered > 0).view_as(flag) | flag)
        return next_tensordict

    def _single_correctness_reward(self, true_answer: str, text: str, cot: str) -> TensorDict:
        return TensorDict(**self.score(true_answer, text, cot))

    def score(self, true_answer: str, text: str, cot: str) -> dict:
        """One reply's scores (``extract_tags`` just read it): the reward and what eval reports beside it."""
        plain = self._special_re.sub(" ", text)
        strict = marked_answer(plain)
        flexible = strict if strict is not None else last_number(plain)
        if self.answer_extraction == "tag":
            tagged = GSM8KRewardParser.extract_tags(text)[1]
            predicted, has_answer = tagged, bool(tagged)
        else:
            predicted = strict if self.answer_extraction == "strict" else flexible
            has_answer = predicted is not None
        correct = has_answer and numbers_match(predicted, true_answer)
        formatted = is_well_formatted(text)
        return dict(
            reward_answer=float(has_answer),
            reward_think=float(bool(cot)),
            reward_right=float(correct),
            reward=float(self.correct_reward * correct + self.format_reward * formatted),
            success=correct,
            correct_strict=strict is not None and numbers_match(strict, true_answer),
            correct_flexible=flexible is not None and numbers_match(flexible, true_answer),
            marked_answer=strict is not None,
        )
