"""Offline text analysis for the IFEval checkers: sentences, words and language.

TorchRL's checkers call nltk's punkt model, which needs the ``punkt_tab`` data at run time
(``LookupError`` on a machine without it), and langdetect unseeded, which is
non-deterministic on short text. Here sentences are split by a regex splitter (no data
files), words of a sentence by nltk's ``NLTKWordTokenizer`` (pure regex, no download), and
languages by one seeded private langdetect ``DetectorFactory``.
"""

from __future__ import annotations

import functools
import re


# Abbreviations after which a period never ends a sentence ("Dr. Smith").
_TITLE_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs cf al approx dept fig no e.g i.e".split()
)
# Abbreviations that may end a sentence: a break only if the next word is capitalised.
_FINAL_ABBREVIATIONS = frozenset(
    "etc inc ltd co corp a.m p.m jan feb apr jun jul aug sep sept oct nov dec".split()
)
_BOUNDARY_RE = re.compile(r"(\.{2,}|\u2026|[.!?]+)([\"'\u201d\u2019\u00bb)\]]*)(?=\s|$)")
_PREV_TOKEN_RE = re.compile(r"(\S*)$")
_NEXT_CHAR_RE = re.compile(r"\s*[\"'\u201c\u2018\u00ab(\[]*(\S?)")
_DOTTED_ACRONYM_RE = re.compile(r"(?:[a-z]\.)+[a-z]")


def _is_sentence_break(text: str, match: re.Match) -> bool:
    punct = match.group(1)
    rest = text[match.end() :]
    if not rest.strip():
        return True
    next_char = _NEXT_CHAR_RE.match(rest).group(1)
    if "!" in punct or "?" in punct:
        return True
    if punct == "\u2026" or len(punct) > 1:  # ellipsis
        return next_char.isupper()
    token = _PREV_TOKEN_RE.search(text, 0, match.start()).group(1)
    token = token.lstrip("\"'\u201c\u2018\u00ab([")
    low = token.lower()
    if low in _TITLE_ABBREVIATIONS:
        return False
    if low in _FINAL_ABBREVIATIONS:
        return next_char.isupper()
    if _DOTTED_ACRONYM_RE.fullmatch(low):  # U.S. / e.g. / Ph.D.
        return False
    if len(token) == 1 and token.isupper():  # an initial: "J. K. Rowling"
        return False
    if token.isdigit():
        # "1. Buy milk" at the start of a line is a list marker, not a sentence end.
        line_start = text.rfind("\n", 0, match.start()) + 1
        if not text[line_start : match.start() - len(token)].strip():
            return False
    return True


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences with a rule-based splitter (no data files needed).

    A sentence ends at ``.``/``!``/``?`` (optionally followed by closing quotes or
    brackets) followed by whitespace or the end of the text, except after known
    abbreviations (``Dr.``, ``e.g.``), initials (``J.``), dotted acronyms (``U.S.``) and
    list markers (``1.`` at a line start); an ellipsis ends a sentence only before a
    capitalised word. Newlines alone do not end a sentence (as in punkt), and trailing
    text without final punctuation is a sentence.
    """
    sentences = []
    start = 0
    for match in _BOUNDARY_RE.finditer(text):
        if _is_sentence_break(text, match):
            sentence = text[start : match.end()].strip()
            if sentence:
                sentences.append(sentence)
            start = match.end()
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def count_sentences(text: str) -> int:
    """Number of sentences of ``text`` according to :func:`split_sentences`."""
    return len(split_sentences(text))


_WORD_RE = re.compile(r"\w+")


def count_words(text: str) -> int:
    """Number of ``\\w+`` runs (the IFEval word count)."""
    return len(_WORD_RE.findall(text))


@functools.cache
def _word_tokenizer():
    # NLTKWordTokenizer is the regex tokenizer behind nltk.word_tokenize; unlike
    # word_tokenize it does not call the punkt sentence model, so it needs no nltk data.
    from nltk.tokenize import NLTKWordTokenizer

    return NLTKWordTokenizer()


def word_tokens(text: str) -> list[str]:
    """nltk-style word tokens (``DON'T`` -> ``DO``, ``N'T``), computed offline."""
    tokenizer = _word_tokenizer()
    return [tok for sent in split_sentences(text) for tok in tokenizer.tokenize(sent)]


LANGDETECT_SEED = 0


@functools.cache
def _language_detector_factory():
    # A private factory (not langdetect's module-level one) so that seeding it does not
    # change the behaviour of other users of langdetect. Profiles ship with the package.
    from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory

    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)
    factory.seed = LANGDETECT_SEED
    return factory


@functools.cache
def supported_languages() -> frozenset[str]:
    """Language codes langdetect can return, plus their primary subtags (``zh``)."""
    langs = set(_language_detector_factory().get_lang_list())
    return frozenset(langs | {lang.split("-")[0] for lang in langs})


@functools.lru_cache(maxsize=4096)
def detect_language(text: str) -> str | None:
    """Deterministic langdetect language code of ``text``; ``None`` if undetectable."""
    from langdetect.lang_detect_exception import LangDetectException

    detector = _language_detector_factory().create()
    detector.append(text)
    try:
        return detector.detect()
    except LangDetectException:
        return None


def is_language(text: str, language: str) -> bool:
    """``text`` is detected as ``language`` (``zh`` also matches ``zh-cn``); undetectable text is not."""
    detected = detect_language(text)
    if detected is None:
        return False
    return detected == language or detected.split("-")[0] == language
