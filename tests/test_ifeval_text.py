"""Tests for grpo/tasks/ifeval_text.py: the offline sentence splitter, word tokens and language detection."""

from __future__ import annotations

import pytest

from grpo.tasks import ifeval_text
from grpo.tasks.ifeval_text import count_sentences, split_sentences, word_tokens


@pytest.mark.parametrize(
    "text, expected",
    [
        ("", 0),
        ("Hello world", 1),
        ("Dr. Smith went to Washington. He arrived at 3 p.m. Then he left!", 3),
        ("i like cats. they are nice. ok", 3),
        ("I live in the U.S. and e.g. in Paris.", 1),
        ("1. Buy milk.\n2. Buy eggs.", 2),
        ("Wait... what? Really?! Yes.", 3),  # an ellipsis before a lowercase word goes on
        ("It was late... The end.", 2),
        ('He said "Hi." Then he left.', 2),
        ("J. K. Rowling wrote books. Mrs. Dalloway did not.", 2),
        ("The price is 3.5 dollars. Cheap.", 2),
        ("no punctuation here\nnor here", 1),
        ("I have 3. You have 4.", 2),
    ],
)
def test_count_sentences(text, expected):
    assert count_sentences(text) == expected, split_sentences(text)


def test_split_sentences_keeps_text():
    assert split_sentences('He said "Hi." Then he left.') == ['He said "Hi."', "Then he left."]



def test_no_nltk_data_needed(monkeypatch):
    import nltk

    def boom(*args, **kwargs):
        raise LookupError("nltk data must not be needed")

    monkeypatch.setattr(nltk.data, "load", boom)
    monkeypatch.setattr(nltk.data, "find", boom)
    assert word_tokens("A BIG DOG. IT RAN.") == ["A", "BIG", "DOG", ".", "IT", "RAN", "."]
    assert word_tokens("We DON'T go.") == ["We", "DO", "N'T", "go", "."]
    assert count_sentences("One. Two.") == 2


def test_language_detection_is_deterministic():
    text = "i like green tea."  # short text: langdetect is unstable without a seed
    first = ifeval_text.detect_language(text)
    ifeval_text.detect_language.cache_clear()
    assert all(ifeval_text.detect_language(text) == first for _ in range(3))
