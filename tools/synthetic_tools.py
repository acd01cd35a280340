"""Deterministic generator of large-number arithmetic problems in GSM8K format.

The twin of :mod:`tools.synthetic` for the tool-use task: every problem is one
operation on numbers too large for a model of a few MB to compute "in its
head", but trivial with a Python tool::

    >>> make_problems(1, seed=0)[0]  # doctest: +SKIP
    {'question': 'What is 48213 * 917?', 'answer': '48213 * 917 = 44211321\\n#### 44211321'}

* ``*``: a 4-5 digit number times a 3-4 digit number;
* ``+``: two 6-7 digit numbers;
* ``-``: two 6-7 digit numbers, the larger first (results are never negative).

The operands always appear in the question in the order of the expression
(``a op b``), under a few phrasings (symbolic and in words). Files written by
:func:`write_splits` are JSON lines with the two keys ``question`` and
``answer`` (``"a op b = r\\n#### r"``), the schema of ``openai/gsm8k``, so the
GSM8K loader and reward read them unchanged; :func:`tools.synthetic.parse_answer`
parses the answers.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tools import synthetic
from tools.synthetic import parse_answer, read_jsonl

__all__ = [
    "OPS",
    "TEMPLATES",
    "expression",
    "make_problems",
    "parse_answer",
    "read_jsonl",
    "write_splits",
]

# Operation -> probability of drawing it.
OPS: dict[str, float] = {"*": 0.4, "+": 0.3, "-": 0.3}

# Question phrasings per operation. Placeholders: {a}, {b}; every phrasing
# names a before b, so the tool call copies the operands in order.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "*": (
        "What is {a} * {b}?",
        "Compute {a} * {b}.",
        "What is {a} times {b}?",
        "Find the product of {a} and {b}.",
    ),
    "+": (
        "What is {a} + {b}?",
        "Compute {a} + {b}.",
        "What is {a} plus {b}?",
        "Find the sum of {a} and {b}.",
    ),
    "-": (
        "What is {a} - {b}?",
        "Compute {a} - {b}.",
        "What is {a} minus {b}?",
        "Find the difference between {a} and {b}.",
    ),
}

# Operand ranges (inclusive).
_MUL_A = (1_000, 99_999)  # 4-5 digits
_MUL_B = (100, 9_999)  # 3-4 digits
_ADD = (100_000, 9_999_999)  # 6-7 digits


def _digits_uniform(rng: random.Random, lo: int, hi: int) -> int:
    """A number in ``[lo, hi]`` whose digit count is uniform (then the value)."""
    nd = rng.randint(len(str(lo)), len(str(hi)))
    return rng.randint(max(lo, 10 ** (nd - 1)), min(hi, 10**nd - 1))


def _operands(op: str, rng: random.Random) -> tuple[int, int, int]:
    if op == "*":
        a = _digits_uniform(rng, *_MUL_A)
        b = _digits_uniform(rng, *_MUL_B)
        return a, b, a * b
    if op == "+":
        a = _digits_uniform(rng, *_ADD)
        b = _digits_uniform(rng, *_ADD)
        return a, b, a + b
    if op == "-":
        a = _digits_uniform(rng, *_ADD)
        b = _digits_uniform(rng, *_ADD)
        if a < b:
            a, b = b, a
        return a, b, a - b
    raise ValueError(f"unknown operation {op!r}")


def _one_problem(rng: random.Random) -> dict:
    op = rng.choices(list(OPS), weights=list(OPS.values()))[0]
    fmt = TEMPLATES[op][rng.randrange(len(TEMPLATES[op]))]
    a, b, result = _operands(op, rng)
    return {"question": fmt.format(a=a, b=b), "answer": f"{a} {op} {b} = {result}\n#### {result}"}


def make_problems(n: int, seed: int | str) -> list[dict]:
    """Return ``n`` distinct problems, deterministically from ``seed``.

    The first ``k`` problems of ``make_problems(n, seed)`` are those of
    ``make_problems(k, seed)``; no two problems share an expression.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = random.Random(f"tools-tiny:{seed}")
    seen: set[str] = set()
    out: list[dict] = []
    while len(out) < n:
        p = _one_problem(rng)
        key = expression(p)
        if key in seen:
            continue
        seen.add(key)
        out.append(p)
    return out


def expression(problem: dict) -> str:
    """The Python expression of ``problem``, e.g. ``"48213 * 917"``."""
    info = parse_answer(problem["answer"])
    return f"{info['a']} {info['op']} {info['b']}"


def write_splits(
    out_dir: str | Path, n_train: int = 2000, n_test: int = 256, seed: int = 0
) -> tuple[Path, Path]:
    """:func:`tools.synthetic.write_splits` of these problems: ``train.jsonl`` and ``test.jsonl`` under ``out_dir``,
    no test expression in the training split."""
    return synthetic.write_splits(out_dir, n_train, n_test, seed, problem_maker=make_problems)


if __name__ == "__main__":  # pragma: no cover
    for p in make_problems(8, seed=0):
        print(json.dumps(p))
