"""GSM8K rewards: correctness of the final number plus a format reward.

TorchRL's ``GSM8KRewardParser`` compares the text inside ``<answer>`` with the
reference by string equality after light normalisation, so "$1,200.00" vs "1200" or
"The answer is 8." vs "8" count as wrong. We keep its tag extraction and env plumbing
and replace only the scoring with a numeric comparison of the final number.

Where the predicted answer is read is ``reward.answer_extraction``: ``tag`` (the text inside
``<answer>``, strict) or ``last_number`` (the ``<answer>`` text when the reply has one, else
the last number anywhere in the reply), for models that never write the tags.

``is_well_formatted`` is the format rule of every task (IFEval's ``format_ok`` is this rule too).
"""

from __future__ import annotations

import math
import re

from tensordict import TensorDict
from torchrl.envs.llm import GSM8KRewardParser

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


ANSWER_EXTRACTIONS = ("tag", "last_number")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
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
    ``success`` is correctness alone (it is what eval accuracy averages).

    ``answer_extraction`` says where the predicted answer is read:

    - ``tag``: the text inside ``<answer>...</answer>`` (its last number is compared);
      ``reward_answer`` is 1 when that text is non-empty.
    - ``last_number``: the ``<answer>`` text when the reply has an ``<answer>...</answer>`` pair
      (the tag wins, even when it holds no number), else the last number anywhere in the reply;
      ``reward_answer`` is 1 when a number was found.

    The format reward is the strict ``<think>…</think><answer>…</answer>`` layout in both modes.
    Special tokens of the tokenizer never count: trailing ones (``<|im_end|>``, ``<|endoftext|>``,
    padding) are stripped before the format check, and all of them are blanked out before a
    number is searched in the reply text.
    """

    def __init__(self, tokenizer, *, correct_reward: float = 1.0, format_reward: float = 0.1,
                 answer_extraction: str = "tag"):
        if answer_extraction not in ANSWER_EXTRACTIONS:
            raise ValueError(
                f"reward.answer_extraction={answer_extraction!r} is unknown; use 'tag' (inside <answer>, strict) "
                "or 'last_number' (the last number in the reply; <answer> still wins when present)."
            )
        super().__init__(tokenizer=tokenizer, correct_reward=correct_reward, format_reward=format_reward)
        self.answer_extraction = answer_extraction
        self._specials = special_tokens(tokenizer)
        self._special_re = re.compile("|".join(map(re.escape, self._specials)))
        self._last_text: str | None = None

    def predicted_answer(self, text: str) -> tuple[str, str]:
        """``(think content, predicted answer)`` of a reply (trailing special tokens already stripped)."""
        cot, tagged = GSM8KRewardParser.extract_tags(text)
        if self.answer_extraction == "tag" or _ANSWER_TAG.search(text):
            return cot, tagged
        numbers = _NUMBER.findall(self._special_re.sub(" ", text).replace("\u2212", "-"))
        return cot, (numbers[-1].strip() if numbers else "")

    def has_answer(self, predicted: str) -> bool:
        if self.answer_extraction == "tag":
            return bool(predicted)
        return parse_number(predicted) is not None

    def extract_tags(self, text: str):
        # The parent's _step calls this once per response, right before
        # _single_correctness_reward, which needs the whole text for the format check.
        self._last_text = strip_trailing_special_tokens(text, self._specials)
        return self.predicted_answer(self._last_text)

    def _single_correctness_reward(self, true_answer: str, potential_answer: str, cot: str) -> TensorDict:
        has_answer = self.has_answer(potential_answer)
        correct = has_answer and numbers_match(potential_answer, true_answer)
        formatted = is_well_formatted(self._last_text or "")
        return TensorDict(
            reward_answer=float(has_answer),
            reward_think=float(bool(cot)),
            reward_right=float(correct),
            reward=self.correct_reward * correct + self.format_reward * formatted,
            success=correct,
        )
