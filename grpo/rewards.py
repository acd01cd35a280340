"""GSM8K rewards: correctness of the final number plus a format reward.

TorchRL's ``GSM8KRewardParser`` compares the text inside ``<answer>`` with the
reference by string equality after light normalisation, so "$1,200.00" vs "1200" or
"The answer is 8." vs "8" count as wrong. We keep its tag extraction and env plumbing
and replace only the scoring with a numeric comparison of the final number.
"""

from __future__ import annotations

import math
import re

from tensordict import TensorDict
from torchrl.envs.llm import GSM8KRewardParser

_NUMBER = re.compile(r"-?\$?\s*\d[\d,]*(?:\.\d+)?|-?\$?\s*\.\d+")
_FORMAT = re.compile(r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.DOTALL)


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
    """``<think>…</think>`` then ``<answer>…</answer>`` and nothing else."""
    return bool(_FORMAT.match(response))


class GSM8KReward(GSM8KRewardParser):
    """TorchRL's GSM8K reward transform with numeric answer matching.

    ``reward = correct_reward * [final number right] + format_reward * [well formatted]``;
    ``success`` is correctness alone (it is what eval accuracy averages).
    """

    def __init__(self, tokenizer, *, correct_reward: float = 1.0, format_reward: float = 0.1):
        super().__init__(tokenizer=tokenizer, correct_reward=correct_reward, format_reward=format_reward)
        self._last_text: str | None = None

    def extract_tags(self, text: str):
        # The parent's _step calls this once per response, right before
        # _single_correctness_reward, which needs the whole text for the format check.
        self._last_text = text
        return GSM8KRewardParser.extract_tags(text)

    def _single_correctness_reward(self, true_answer: str, potential_answer: str, cot: str) -> TensorDict:
        correct = bool(potential_answer) and numbers_match(potential_answer, true_answer)
        formatted = is_well_formatted(self._last_text or "")
        return TensorDict(
            reward_answer=float(bool(potential_answer)),
            reward_think=float(bool(cot)),
            reward_right=float(correct),
            reward=self.correct_reward * correct + self.format_reward * formatted,
            success=correct,
        )
