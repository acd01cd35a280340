"""Deterministic generator of tiny GSM8K-format word problems.

Every problem is a one-operation word problem (``+``, ``-`` or a small ``*``)
whose answer follows the GSM8K convention: a short worked solution, a newline,
then ``#### N``::

    >>> make_problems(1, seed=0)[0]  # doctest: +SKIP
    {'question': 'Tom has 3 apples. He buys 5 more. How many apples does Tom have now?',
     'answer': '3 + 5 = 8\\n#### 8'}

The problems are deliberately small (operands in ``0..20``, a handful of
templates, names and objects) so that a model of a few MB can learn them on a
CPU in minutes. Files written by :func:`write_splits` are JSON lines with the
two keys ``question`` and ``answer``, i.e. the same schema as ``openai/gsm8k``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "NAMES",
    "OBJECTS",
    "TEMPLATES",
    "make_problems",
    "parse_answer",
    "write_splits",
    "read_jsonl",
]

# (name, subject pronoun)
NAMES: tuple[tuple[str, str], ...] = (
    ("Tom", "He"),
    ("Anna", "She"),
    ("Sam", "He"),
    ("Lily", "She"),
    ("Ben", "He"),
    ("Mia", "She"),
    ("Max", "He"),
    ("Emma", "She"),
)

OBJECTS: tuple[str, ...] = (
    "apples",
    "pencils",
    "cookies",
    "marbles",
    "books",
    "stickers",
    "cards",
    "eggs",
)

# Each template: (operation, question format). Placeholders: {name}, {pron},
# {obj}, {a}, {b}.
TEMPLATES: tuple[tuple[str, str], ...] = (
    ("+", "{name} has {a} {obj}. {pron} buys {b} more. How many {obj} does {name} have now?"),
    ("+", "{name} had {a} {obj} and found {b} more. How many {obj} does {name} have in total?"),
    ("+", "There are {a} {obj} in a box. {name} puts {b} more {obj} in the box. How many {obj} are in the box now?"),
    ("-", "{name} has {a} {obj}. {pron} gives {b} to a friend. How many {obj} does {name} have left?"),
    ("-", "{name} had {a} {obj} and lost {b} of them. How many {obj} does {name} have now?"),
    ("-", "There are {a} {obj} on the table. {name} takes {b} of them. How many {obj} are left on the table?"),
    ("*", "{name} has {a} bags with {b} {obj} in each bag. How many {obj} does {name} have?"),
    ("*", "{name} buys {a} boxes of {obj}. Each box has {b} {obj}. How many {obj} did {name} buy?"),
)

# Operand ranges per operation (inclusive).
_ADD_MAX = 20
_SUB_MAX = 20
_MUL_A = (2, 5)
_MUL_B = (2, 9)

_ANSWER_RE = re.compile(r"^(\d+) ([+\-*]) (\d+) = (\d+)\n#### (\d+)$")


def _operands(op: str, rng: random.Random) -> tuple[int, int, int]:
    if op == "+":
        a = rng.randint(0, _ADD_MAX)
        b = rng.randint(0, _ADD_MAX)
        return a, b, a + b
    if op == "-":
        a = rng.randint(1, _SUB_MAX)
        b = rng.randint(0, a)
        return a, b, a - b
    if op == "*":
        a = rng.randint(*_MUL_A)
        b = rng.randint(*_MUL_B)
        return a, b, a * b
    raise ValueError(f"unknown operation {op!r}")


def _one_problem(rng: random.Random) -> dict:
    op, fmt = TEMPLATES[rng.randrange(len(TEMPLATES))]
    name, pron = NAMES[rng.randrange(len(NAMES))]
    obj = OBJECTS[rng.randrange(len(OBJECTS))]
    a, b, result = _operands(op, rng)
    question = fmt.format(name=name, pron=pron, obj=obj, a=a, b=b)
    answer = f"{a} {op} {b} = {result}\n#### {result}"
    return {"question": question, "answer": answer}


def make_problems(n: int, seed: int) -> list[dict]:
    """Return ``n`` distinct problems, deterministically from ``seed``.

    Each problem is a dict with keys ``question`` and ``answer``; ``answer`` is
    ``"<a> <op> <b> = <r>\\n#### <r>"``. The same ``(n, seed)`` always gives the
    same list, and the first ``k`` problems of ``make_problems(n, seed)`` are
    those of ``make_problems(k, seed)``.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = random.Random(f"gsm8k-tiny:{seed}")
    seen: set[str] = set()
    out: list[dict] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise RuntimeError(f"could not draw {n} distinct problems")
        p = _one_problem(rng)
        if p["question"] in seen:
            continue
        seen.add(p["question"])
        out.append(p)
    return out


def parse_answer(answer: str) -> dict:
    """Parse a generated ``answer`` string.

    Returns a dict with ``a``, ``op``, ``b``, ``result`` (ints / str) and
    ``equation`` (the worked-solution line, e.g. ``"3 + 5 = 8"``).
    """
    m = _ANSWER_RE.match(answer)
    if m is None:
        raise ValueError(f"not a synthetic GSM8K answer: {answer!r}")
    a, op, b, r, final = m.groups()
    if r != final:
        raise ValueError(f"inconsistent answer: {answer!r}")
    return {
        "a": int(a),
        "op": op,
        "b": int(b),
        "result": int(r),
        "equation": f"{a} {op} {b} = {r}",
    }


def write_splits(
    out_dir: str | Path, n_train: int = 2000, n_test: int = 256, seed: int = 0, *,
    problem_maker: Callable[[int, int], list[dict]] | None = None,
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` under ``out_dir``.

    Questions are drawn from one deduplicated stream (``problem_maker(n, seed)``;
    default :func:`make_problems`), test first, so no test question appears in
    the training split. Returns the two paths.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    problems = (problem_maker or make_problems)(n_train + n_test, seed)
    test, train = problems[:n_test], problems[n_test:]
    paths = []
    for split, rows in (("train", train), ("test", test)):
        path = out_dir / f"{split}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        paths.append(path)
    return paths[0], paths[1]


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSON-lines file into a list of dicts."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
