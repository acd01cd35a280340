"""Tests for the synthetic GSM8K-format generator and the shipped splits."""

import json
import re
from pathlib import Path

import pytest

from tools.synthetic import make_problems, parse_answer, read_jsonl, write_splits

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "gsm8k_tiny"
ANSWER_RE = re.compile(r"^(\d+) ([+\-*]) (\d+) = (\d+)\n#### (\d+)$")


def _check(problem):
    assert set(problem) == {"question", "answer"}
    assert problem["question"].endswith("?")
    m = ANSWER_RE.match(problem["answer"])
    assert m, problem["answer"]
    a, op, b, r, final = m.groups()
    a, b, r, final = int(a), int(b), int(r), int(final)
    assert r == final == {"+": a + b, "-": a - b, "*": a * b}[op]
    assert r >= 0
    # the operands appear in the question, in order
    assert re.search(rf"\b{a}\b.*\b{b}\b", problem["question"]), problem
    # exactly one "#### " (TorchRL's reward parser splits on it)
    assert problem["answer"].count("#### ") == 1


def test_make_problems_deterministic_and_well_formed():
    a = make_problems(300, seed=7)
    b = make_problems(300, seed=7)
    assert a == b
    assert make_problems(300, seed=8) != a
    assert make_problems(50, seed=7) == a[:50]
    assert len({p["question"] for p in a}) == 300
    for p in a:
        _check(p)
    assert {parse_answer(p["answer"])["op"] for p in a} == {"+", "-", "*"}


def test_parse_answer():
    info = parse_answer("3 + 5 = 8\n#### 8")
    assert info == {"a": 3, "op": "+", "b": 5, "result": 8, "equation": "3 + 5 = 8"}
    with pytest.raises(ValueError):
        parse_answer("3 + 5 = 8\n#### 9")
    with pytest.raises(ValueError):
        parse_answer("eight")


def test_write_splits_disjoint(tmp_path):
    train_path, test_path = write_splits(tmp_path, n_train=120, n_test=40, seed=3)
    train, test = read_jsonl(train_path), read_jsonl(test_path)
    assert (len(train), len(test)) == (120, 40)
    assert not {p["question"] for p in train} & {p["question"] for p in test}
    # deterministic: writing again gives the same bytes
    again = write_splits(tmp_path / "again", n_train=120, n_test=40, seed=3)
    assert again[0].read_bytes() == train_path.read_bytes()
    assert again[1].read_bytes() == test_path.read_bytes()


def test_shipped_data():
    train = read_jsonl(DATA / "train.jsonl")
    test = read_jsonl(DATA / "test.jsonl")
    assert len(train) == 2000 and len(test) == 256
    assert not {p["question"] for p in train} & {p["question"] for p in test}
    for p in train[:200] + test:
        _check(p)
    # every line is a standalone JSON object with the GSM8K keys
    first = (DATA / "train.jsonl").read_text().splitlines()[0]
    assert set(json.loads(first)) == {"question", "answer"}
    # the shipped files are what the generator gives for seed 0
    expected = make_problems(2256, seed=0)
    assert test == expected[:256] and train == expected[256:]
