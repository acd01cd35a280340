"""IFEval as a GRPO task, its data and scoring: rows, strict/loose evaluation, the reward of one reply.
The TorchRL side (the reward transform and the env) is in :mod:`grpo.tasks.ifeval_env`.

Rows load through :func:`grpo.tasks.data.load_split`, like every task's data, and are validated by
:func:`grpo.tasks.ifeval_checks.validate_rows`. Evaluation follows the IFEval paper / reference
implementation (strict and loose, prompt- and instruction-level accuracy); deliberate
differences are listed in ``docs/ifeval.md``. The accuracy names follow TorchRL's ``IFEvalScoreData``
(``prompt_level_strict_acc``...).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grpo.process.errors import ConfigError, DataError
from grpo.tasks.data import load_split
from grpo.tasks.ifeval_checks import ROW_FIELDS, check_instruction, normalize_kwargs, validate_rows
from grpo.tasks.rewards import is_well_formatted


# --------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------


def _normalize_row(row: dict[str, Any]) -> dict[str, Any]:
    kwargs_list = row["kwargs"]
    if isinstance(kwargs_list, list):  # anything else is left for validate_rows to report
        row["kwargs"] = [normalize_kwargs(k) if isinstance(k, Mapping) or k is None else k for k in kwargs_list]
    return row


def load_ifeval_rows(path_or_name: str | os.PathLike, split: str = "train") -> list[dict]:
    """The rows of one split, normalised (None kwargs dropped) and validated.

    ``path_or_name`` is anything :func:`grpo.tasks.data.load_split` reads: a jsonl/parquet/csv file,
    a folder holding ``{split}.jsonl``, a ``save_to_disk`` folder, or a hub name such as
    ``google/IFEval``. Every problem is a :class:`DataError` naming the data set, the split
    and, for a bad row, its index, key and instruction.
    """
    name = os.fspath(path_or_name)
    rows = [_normalize_row(row) for row in load_split(name, split, required_fields=ROW_FIELDS).to_list()]
    validate_rows(rows, source=f"env.dataset={name!r} split {split!r} ")
    return rows


# --------------------------------------------------------------------------------------
# Strict / loose evaluation
# --------------------------------------------------------------------------------------

ACCURACY_KEYS = (
    "prompt_level_strict_acc",
    "inst_level_strict_acc",
    "prompt_level_loose_acc",
    "inst_level_loose_acc",
)


def loose_variants(response: str) -> list[str]:
    """The IFEval loose variants: as is, without the first line, the last line, both;
    each also with every ``*`` removed (markdown)."""
    lines = response.split("\n")
    variants = [
        response,
        "\n".join(lines[1:]).strip(),
        "\n".join(lines[:-1]).strip(),
        "\n".join(lines[1:-1]).strip(),
    ]
    return variants + [v.replace("*", "") for v in variants]


@dataclass
class IFEvalResult:
    """Per-instruction strict/loose outcome for one response."""

    instruction_ids: list[str]
    strict: list[bool]
    loose: list[bool]

    def accuracies(self) -> dict[str, float]:
        n = len(self.strict)
        return {
            "prompt_level_strict_acc": float(all(self.strict)),
            "inst_level_strict_acc": sum(self.strict) / n if n else 0.0,
            "prompt_level_loose_acc": float(all(self.loose)),
            "inst_level_loose_acc": sum(self.loose) / n if n else 0.0,
        }


def evaluate_response(
    response: str,
    instruction_ids: Sequence[str],
    kwargs_list: Sequence[Mapping[str, Any] | None] | None = None,
) -> IFEvalResult:
    """Strict and loose IFEval evaluation of ``response`` against each instruction."""
    instruction_ids = list(instruction_ids)
    if not instruction_ids:
        raise DataError("empty instruction id list")
    if kwargs_list is None:
        kwargs_list = [{}] * len(instruction_ids)
    if len(kwargs_list) != len(instruction_ids):
        raise DataError(
            f"{len(instruction_ids)} instruction ids but {len(kwargs_list)} kwargs dicts"
        )
    variants = loose_variants(response)
    strict, loose = [], []
    for instruction_id, kwargs in zip(instruction_ids, kwargs_list, strict=True):
        followed = check_instruction(instruction_id, response, kwargs)
        strict.append(followed)
        loose.append(followed or any(check_instruction(instruction_id, v, kwargs) for v in variants))
    return IFEvalResult(instruction_ids, strict, loose)


# --------------------------------------------------------------------------------------
# Reward
# --------------------------------------------------------------------------------------

DEFAULT_REWARD_WEIGHTS: dict[str, float] = {
    "prompt_strict": 0.4,
    "inst_strict": 0.3,
    "prompt_loose": 0.2,
    "inst_loose": 0.1,
    "format": 0.1,
}
_WEIGHT_TO_KEY = {
    "prompt_strict": "prompt_level_strict_acc",
    "inst_strict": "inst_level_strict_acc",
    "prompt_loose": "prompt_level_loose_acc",
    "inst_loose": "inst_level_loose_acc",
    "format": "format_ok",
}

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(response: str) -> str | None:
    """Stripped content of the first ``<answer>...</answer>`` block, or ``None``."""
    match = _ANSWER_RE.search(response)
    return match.group(1).strip() if match else None


def resolve_weights(weights: Mapping[str, float] | None) -> dict[str, float]:
    """Defaults overridden by ``weights``; unknown names raise (catches config typos)."""
    out = dict(DEFAULT_REWARD_WEIGHTS)
    if weights is not None:
        unknown = sorted(set(weights) - set(out))
        if unknown:
            raise ConfigError(
                f"reward.ifeval_weights: unknown names {unknown}; the known ones are {list(out)}."
            )
        out.update({k: float(v) for k, v in weights.items()})
    return out


def ifeval_reward(
    response_text: str,
    instruction_ids: Sequence[str],
    kwargs_list: Sequence[Mapping[str, Any] | None] | None,
    weights: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Reward of one response.

    The instructions are checked on the ``<answer>`` block when there is one, otherwise on
    the whole response. Returns the four accuracies, ``format_ok`` (0/1), ``reward`` =
    ``w[prompt_strict]*prompt_level_strict_acc + w[inst_strict]*inst_level_strict_acc +
    w[prompt_loose]*prompt_level_loose_acc + w[inst_loose]*inst_level_loose_acc +
    w[format]*format_ok``, and the per-instruction ``strict`` / ``loose`` lists.
    """
    w = resolve_weights(weights)
    answer = extract_answer(response_text)
    target = answer if answer is not None else response_text
    result = evaluate_response(target, instruction_ids, kwargs_list)
    out: dict[str, Any] = result.accuracies()
    out["format_ok"] = float(is_well_formatted(response_text))
    out["reward"] = sum(w[name] * out[key] for name, key in _WEIGHT_TO_KEY.items())
    out["strict"] = result.strict
    out["loose"] = result.loose
    return out
