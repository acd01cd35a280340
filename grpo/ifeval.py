"""IFEval verifiable instruction-following rewards that run fully offline.

What is taken from TorchRL and what is replaced
-----------------------------------------------
TorchRL 0.14 ships ``torchrl.envs.llm.IFEvalEnv`` (data pipeline) and
``torchrl.envs.llm.IfEvalScorer`` (checkers + reward transform).

*Used as is*: the environment side. ``IFEvalEnv`` / ``DatasetChatEnv`` load the rows,
put ``key``, ``query`` (the prompt), ``instruction_id_list`` and ``kwargs`` in the
tensordict and build the chat history; :class:`IFEvalReward` reads exactly those fields,
so it can be appended to an ``IFEvalEnv(..., compute_reward=False)``.
:func:`make_ifeval_env` is an ``IFEvalEnv`` whose loader validates the rows first.
The accuracy names follow TorchRL's ``IFEvalScoreData`` (``prompt_level_strict_acc``...).

*Replaced*: the checkers and the scorer transform, because in 0.14.1 they are not usable
as a training reward:

1. ``length_constraints:number_sentences`` and ``change_case:capital_word_frequency`` call
   nltk's punkt model (``nltk.data.load`` / ``nltk.word_tokenize``), which needs the
   ``punkt_tab`` data at run time: ``LookupError`` on a machine without it. Here sentences
   are split by our own regex splitter (:func:`split_sentences`, no data files) and words of
   a sentence by nltk's ``NLTKWordTokenizer``, which is pure regex and needs no download.
2. Missing kwargs are silently replaced by *random* values (thresholds, relations,
   keywords), and the scorer drops every falsy kwarg (``if v``), so ``0`` also becomes
   random; ``keywords:letter_frequency`` replaces any ``letter`` that is not ``a-z`` by a
   random letter, which hits real IFEval rows (``"letter": "#"``, ``"!"``). The reward is then
   non-deterministic. Here kwargs are validated (:func:`validate_rows`) and never invented.
3. ``langdetect`` is used unseeded (non-deterministic on short text) and a detection failure
   counts as *followed*. Here one seeded private ``DetectorFactory`` is used and failure
   counts as not followed (a response with no letters must not earn a language reward).
   ``change_case:english_capital`` runs langdetect on the all-caps text, where langdetect
   ignores every word (it skips all-caps words as acronyms); here it runs on the lowercased
   text.
4. Keyword arguments are interpolated into regexes unescaped (a keyword with ``+`` or ``(``
   raises or mismatches). Here they are escaped.
5. ``IfEvalScorer`` scores only the text inside ``<answer>`` (an untagged response is scored
   as ``""`` and fails everything), supports only history mode, and its reward weights are a
   list; the format bonus is fixed. :class:`IFEvalReward` checks the ``<answer>`` block when
   present and the whole response otherwise, supports history/text/tokens modes and takes
   its weights as a plain dict (Hydra friendly).

Semantics otherwise follow the IFEval paper / reference implementation (strict and loose
evaluation, prompt- and instruction-level accuracy). Deliberate differences are listed in
``docs/ifeval.md``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform

__all__ = [
    "ACCURACY_KEYS",
    "DEFAULT_REWARD_WEIGHTS",
    "IFEvalDataError",
    "IFEvalResult",
    "IFEvalReward",
    "InstructionSpec",
    "KwargSpec",
    "REGISTRY",
    "SUPPORTED_INSTRUCTION_IDS",
    "aggregate",
    "check_instruction",
    "collate_ifeval_rows",
    "count_sentences",
    "count_words",
    "evaluate_response",
    "extract_answer",
    "format_ok",
    "ifeval_reward",
    "load_ifeval_rows",
    "loose_variants",
    "make_ifeval_env",
    "normalize_kwargs",
    "split_sentences",
    "validate_rows",
]


class IFEvalDataError(ValueError):
    """An IFEval row is malformed: unsupported instruction id or bad kwargs."""


# --------------------------------------------------------------------------------------
# Text utilities
# --------------------------------------------------------------------------------------

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


def _is_language(text: str, language: str) -> bool:
    detected = detect_language(text)
    if detected is None:
        return False
    return detected == language or detected.split("-")[0] == language


# --------------------------------------------------------------------------------------
# Checkers: check(response, **kwargs) -> bool. Kwargs are validated beforehand.
# --------------------------------------------------------------------------------------

LESS_THAN, AT_LEAST = "less than", "at least"
RELATIONS = (LESS_THAN, AT_LEAST)


def _compare(count: int, relation: str, threshold: int) -> bool:
    return count < threshold if relation == LESS_THAN else count >= threshold


def _keywords_existence(response: str, *, keywords: Sequence[str]) -> bool:
    return all(re.search(re.escape(k), response, re.IGNORECASE) for k in keywords)


def _keywords_frequency(
    response: str, *, keyword: str, frequency: int, relation: str
) -> bool:
    count = len(re.findall(re.escape(keyword.strip()), response, re.IGNORECASE))
    return _compare(count, relation, frequency)


def _keywords_forbidden(response: str, *, forbidden_words: Sequence[str]) -> bool:
    return not any(
        re.search(r"\b" + re.escape(w) + r"\b", response, re.IGNORECASE)
        for w in forbidden_words
    )


def _keywords_letter_frequency(
    response: str, *, letter: str, let_frequency: int, let_relation: str
) -> bool:
    count = response.lower().count(letter.strip().lower())
    return _compare(count, let_relation, let_frequency)


def _response_language(response: str, *, language: str) -> bool:
    return _is_language(response, language)


def _number_sentences(response: str, *, num_sentences: int, relation: str) -> bool:
    return _compare(count_sentences(response), relation, num_sentences)


def _number_words(response: str, *, num_words: int, relation: str) -> bool:
    return _compare(count_words(response), relation, num_words)


def _number_paragraphs(response: str, *, num_paragraphs: int) -> bool:
    # Paragraphs are separated by the markdown divider ***; an empty paragraph is only
    # tolerated before the first or after the last divider.
    parts = re.split(r"\s?\*\*\*\s?", response)
    count = len(parts)
    for index, part in enumerate(parts):
        if not part.strip():
            if index in (0, len(parts) - 1):
                count -= 1
            else:
                return False
    return count == num_paragraphs


_FIRST_WORD_STOP = set(".,?!'\"")


def _nth_paragraph_first_word(
    response: str, *, num_paragraphs: int, nth_paragraph: int, first_word: str
) -> bool:
    # Paragraphs are separated by blank lines ("\n\n"). Unlike the reference code, the
    # n-th paragraph is counted among the non-empty ones (extra blank lines do not shift it).
    paragraphs = [p.strip() for p in response.split("\n\n") if p.strip()]
    if len(paragraphs) != num_paragraphs or nth_paragraph > len(paragraphs):
        return False
    word = paragraphs[nth_paragraph - 1].split()[0].lstrip("'\"")
    prefix = []
    for char in word:
        if char in _FIRST_WORD_STOP:
            break
        prefix.append(char.lower())
    return "".join(prefix) == first_word.strip().lower()


def _number_placeholders(response: str, *, num_placeholders: int) -> bool:
    return len(re.findall(r"\[.*?\]", response)) >= num_placeholders


def _postscript(response: str, *, postscript_marker: str) -> bool:
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + re.escape(marker.lower()) + r".*$"
    return bool(re.findall(pattern, response.lower(), flags=re.MULTILINE))


def _number_bullet_lists(response: str, *, num_bullets: int) -> bool:
    stars = re.findall(r"^\s*\*[^\*].*$", response, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", response, flags=re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


CONSTRAINED_RESPONSE_OPTIONS = ("My answer is yes.", "My answer is no.", "My answer is maybe.")


def _constrained_response(response: str) -> bool:
    response = response.strip()
    return any(option in response for option in CONSTRAINED_RESPONSE_OPTIONS)


def _number_highlighted_sections(response: str, *, num_highlights: int) -> bool:
    singles = re.findall(r"\*[^\n\*]*\*", response)
    doubles = re.findall(r"\*\*[^\n\*]*\*\*", response)
    count = sum(1 for h in singles if h.strip("*").strip())
    count += sum(1 for h in doubles if h[2:-2].strip())
    return count >= num_highlights


def _multiple_sections(response: str, *, section_spliter: str, num_sections: int) -> bool:
    pattern = r"\s?" + re.escape(section_spliter.strip()) + r"\s?\d+\s?"
    return len(re.split(pattern, response)) - 1 >= num_sections


def _json_format(response: str) -> bool:
    value = response.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        if value.startswith(prefix):
            value = value[len(prefix) :]
            break
    value = value.removesuffix("```").strip()
    try:
        json.loads(value)
    except ValueError:
        return False
    return True


def _title(response: str) -> bool:
    return any(t.strip("<>").strip() for t in re.findall(r"<<[^\n]+>>", response))


def _two_responses(response: str) -> bool:
    parts = response.split("******")
    valid = []
    for index, part in enumerate(parts):
        if part.strip():
            valid.append(part.strip())
        elif index not in (0, len(parts) - 1):
            return False
    return len(valid) == 2 and valid[0] != valid[1]


def _repeat_prompt(response: str, *, prompt_to_repeat: str) -> bool:
    return response.strip().lower().startswith(prompt_to_repeat.strip().lower())


def _end_checker(response: str, *, end_phrase: str) -> bool:
    return response.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def _quotation(response: str) -> bool:
    value = response.strip()
    return len(value) > 1 and value[0] == '"' and value[-1] == '"'


def _english_capital(response: str) -> bool:
    # langdetect skips words written in capitals (it takes them for acronyms), so on an
    # all-caps text it sees almost nothing: "CATS SLEEP ALL DAY." is detected as German.
    # The case is checked by isupper(); the language is detected on the lowercased text.
    return response.isupper() and _is_language(response.lower(), "en")


def _english_lowercase(response: str) -> bool:
    return response.islower() and _is_language(response, "en")


def _capital_word_frequency(
    response: str, *, capital_frequency: int, capital_relation: str
) -> bool:
    count = sum(1 for tok in word_tokens(response) if tok.isupper())
    return _compare(count, capital_relation, capital_frequency)


def _no_comma(response: str) -> bool:
    return "," not in response


# --------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------

_KWARG_KINDS = ("int", "str", "char", "str_list")


@dataclass(frozen=True)
class KwargSpec:
    """One keyword argument of an instruction.

    ``kind``: ``"int"`` (an int, not a bool, ``>= minimum``), ``"str"`` (non-empty string),
    ``"char"`` (a one-character string) or ``"str_list"`` (non-empty list of non-empty
    strings). ``choices`` restricts the allowed values.
    """

    name: str
    kind: Literal["int", "str", "char", "str_list"]
    required: bool = True
    choices: tuple | None = None
    minimum: int | None = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not acceptable, or ``None`` if it is."""
        if self.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                return f"expected an int, got {type(value).__name__} {value!r}"
            if self.minimum is not None and value < self.minimum:
                return f"must be >= {self.minimum}, got {value}"
        elif self.kind in ("str", "char"):
            if not isinstance(value, str) or not value.strip():
                return f"expected a non-empty string, got {type(value).__name__} {value!r}"
            if self.kind == "char" and len(value.strip()) != 1:
                return f"expected a single character, got {value!r}"
        elif self.kind == "str_list":
            if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
                return f"expected a non-empty list of strings, got {type(value).__name__} {value!r}"
            if not all(isinstance(v, str) and v.strip() for v in value):
                return f"expected a list of non-empty strings, got {value!r}"
        if self.choices is not None and value not in self.choices:
            return f"must be one of {list(self.choices)}, got {value!r}"
        return None


@dataclass(frozen=True)
class InstructionSpec:
    """A supported instruction: its id, accepted kwargs and checker."""

    id: str
    check: Callable[..., bool]
    kwargs: tuple[KwargSpec, ...] = ()
    description: str = ""
    extra_check: Callable[[dict], str | None] | None = field(default=None, repr=False)

    @property
    def accepted(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kwargs)

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.kwargs if k.required)

    def problems(self, kwargs: Mapping[str, Any]) -> list[str]:
        """Everything wrong with ``kwargs`` (None-valued entries count as unset)."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        specs = {k.name: k for k in self.kwargs}
        out = []
        unknown = sorted(set(kwargs) - set(specs))
        if unknown:
            out.append(f"unknown kwargs {unknown} (accepted: {list(specs)})")
        missing = [name for name in self.required if name not in kwargs]
        if missing:
            out.append(f"missing required kwargs {missing}")
        for name, value in kwargs.items():
            if name in specs and (problem := specs[name].problem(value)) is not None:
                out.append(f"kwarg {name!r}: {problem}")
        if not out and self.extra_check is not None:
            if (problem := self.extra_check(kwargs)) is not None:
                out.append(problem)
        return out

    def __call__(self, response: str, **kwargs: Any) -> bool:
        return bool(self.check(response, **kwargs))


def _int(name: str, minimum: int = 0) -> KwargSpec:
    return KwargSpec(name, "int", minimum=minimum)


def _relation(name: str) -> KwargSpec:
    return KwargSpec(name, "str", choices=RELATIONS)


def _check_nth_paragraph(kwargs: dict) -> str | None:
    if kwargs["nth_paragraph"] > kwargs["num_paragraphs"]:
        return (
            f"nth_paragraph ({kwargs['nth_paragraph']}) must be <= "
            f"num_paragraphs ({kwargs['num_paragraphs']})"
        )
    return None


def _check_language(kwargs: dict) -> str | None:
    if kwargs["language"] not in supported_languages():
        return (
            f"language {kwargs['language']!r} is not a langdetect code "
            f"(supported: {sorted(supported_languages())})"
        )
    return None


_SPECS = (
    InstructionSpec(
        "keywords:existence", _keywords_existence, (KwargSpec("keywords", "str_list"),),
        "Every keyword appears (case-insensitive substring).",
    ),
    InstructionSpec(
        "keywords:frequency", _keywords_frequency,
        (KwargSpec("keyword", "str"), _int("frequency"), _relation("relation")),
        "The keyword appears <relation> <frequency> times (case-insensitive).",
    ),
    InstructionSpec(
        "keywords:forbidden_words", _keywords_forbidden,
        (KwargSpec("forbidden_words", "str_list"),),
        "None of the words appears as a whole word (case-insensitive).",
    ),
    InstructionSpec(
        "keywords:letter_frequency", _keywords_letter_frequency,
        (KwargSpec("letter", "char"), _int("let_frequency"), _relation("let_relation")),
        "The character appears <let_relation> <let_frequency> times (case-insensitive).",
    ),
    InstructionSpec(
        "language:response_language", _response_language, (KwargSpec("language", "str"),),
        "langdetect (seeded) detects <language>.", extra_check=_check_language,
    ),
    InstructionSpec(
        "length_constraints:number_sentences", _number_sentences,
        (_int("num_sentences"), _relation("relation")),
        "Sentence count <relation> <num_sentences>.",
    ),
    InstructionSpec(
        "length_constraints:number_paragraphs", _number_paragraphs,
        (_int("num_paragraphs", 1),),
        "Exactly <num_paragraphs> paragraphs separated by ***.",
    ),
    InstructionSpec(
        "length_constraints:number_words", _number_words,
        (_int("num_words"), _relation("relation")),
        "Word count (\\w+ runs) <relation> <num_words>.",
    ),
    InstructionSpec(
        "length_constraints:nth_paragraph_first_word", _nth_paragraph_first_word,
        (_int("num_paragraphs", 1), _int("nth_paragraph", 1), KwargSpec("first_word", "str")),
        "Exactly <num_paragraphs> blank-line separated paragraphs; paragraph <nth_paragraph> "
        "starts with <first_word>.",
        extra_check=_check_nth_paragraph,
    ),
    InstructionSpec(
        "detectable_content:number_placeholders", _number_placeholders,
        (_int("num_placeholders"),),
        "At least <num_placeholders> [placeholders].",
    ),
    InstructionSpec(
        "detectable_content:postscript", _postscript, (KwargSpec("postscript_marker", "str"),),
        "A line contains the postscript marker (P.S. / P.P.S / other).",
    ),
    InstructionSpec(
        "detectable_format:number_bullet_lists", _number_bullet_lists,
        (_int("num_bullets"),),
        "Exactly <num_bullets> lines starting with '* ' or '-'.",
    ),
    InstructionSpec(
        "detectable_format:constrained_response", _constrained_response, (),
        "Contains 'My answer is yes.', 'My answer is no.' or 'My answer is maybe.'.",
    ),
    InstructionSpec(
        "detectable_format:number_highlighted_sections", _number_highlighted_sections,
        (_int("num_highlights"),),
        "At least <num_highlights> *highlighted* or **highlighted** sections.",
    ),
    InstructionSpec(
        "detectable_format:multiple_sections", _multiple_sections,
        (KwargSpec("section_spliter", "str"), _int("num_sections")),
        "At least <num_sections> sections marked '<section_spliter> N'.",
    ),
    InstructionSpec(
        "detectable_format:json_format", _json_format, (),
        "The whole response (optionally in ``` fences) parses as JSON.",
    ),
    InstructionSpec(
        "detectable_format:title", _title, (), "Contains a non-empty <<title>>.",
    ),
    InstructionSpec(
        "combination:two_responses", _two_responses, (),
        "Exactly two different responses separated by ******.",
    ),
    InstructionSpec(
        "combination:repeat_prompt", _repeat_prompt, (KwargSpec("prompt_to_repeat", "str"),),
        "Starts with <prompt_to_repeat> (case-insensitive).",
    ),
    InstructionSpec(
        "startend:end_checker", _end_checker, (KwargSpec("end_phrase", "str"),),
        "Ends with <end_phrase> (case-insensitive, surrounding quotes ignored).",
    ),
    InstructionSpec(
        "startend:quotation", _quotation, (), "Wrapped in double quotation marks.",
    ),
    InstructionSpec(
        "change_case:english_capital", _english_capital, (),
        "All letters upper case and detected as English.",
    ),
    InstructionSpec(
        "change_case:english_lowercase", _english_lowercase, (),
        "All letters lower case and detected as English.",
    ),
    InstructionSpec(
        "change_case:capital_word_frequency", _capital_word_frequency,
        (_int("capital_frequency"), _relation("capital_relation")),
        "Number of all-caps word tokens <capital_relation> <capital_frequency>.",
    ),
    InstructionSpec(
        "punctuation:no_comma", _no_comma, (), "No ASCII comma.",
    ),
)

REGISTRY: dict[str, InstructionSpec] = {spec.id: spec for spec in _SPECS}
SUPPORTED_INSTRUCTION_IDS: tuple[str, ...] = tuple(sorted(REGISTRY))


def normalize_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Drop None-valued entries (unset in the google/IFEval hub format).

    Integral floats become ints (a nullable int column can come back as float).
    """
    out = {}
    for key, value in (kwargs or {}).items():
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        out[key] = value
    return out


def _instruction_problems(instruction_id: Any, kwargs: Any) -> list[str]:
    if not isinstance(instruction_id, str) or instruction_id not in REGISTRY:
        return [f"unsupported instruction id (supported: {list(SUPPORTED_INSTRUCTION_IDS)})"]
    if kwargs is not None and not isinstance(kwargs, Mapping):
        return [f"kwargs must be a dict, got {type(kwargs).__name__}"]
    return REGISTRY[instruction_id].problems(normalize_kwargs(kwargs))


def check_instruction(instruction_id: str, response: str, kwargs: Mapping | None = None) -> bool:
    """Strict check of one instruction on ``response`` (empty responses never pass)."""
    problems = _instruction_problems(instruction_id, kwargs)
    if problems:
        raise IFEvalDataError(f"instruction {instruction_id!r}: {'; '.join(problems)}")
    if not response.strip():
        return False
    return REGISTRY[instruction_id](response, **normalize_kwargs(kwargs))


# --------------------------------------------------------------------------------------
# Row validation and loading
# --------------------------------------------------------------------------------------


def validate_rows(rows: Sequence[Mapping[str, Any]]) -> None:
    """Raise :class:`IFEvalDataError` on the first malformed row.

    Each row needs ``key`` (int), ``prompt`` (str), ``instruction_id_list`` (non-empty list
    of supported ids) and ``kwargs`` (list of dicts, one per instruction; None-valued
    entries mean unset). The message names the row index, its key and the instruction id.
    """
    for index, row in enumerate(rows):
        key = row.get("key") if isinstance(row, Mapping) else None
        where = f"row {index} (key={key!r})"
        if not isinstance(row, Mapping):
            raise IFEvalDataError(f"{where}: expected a dict, got {type(row).__name__}")
        missing = [f for f in ("key", "prompt", "instruction_id_list", "kwargs") if f not in row]
        if missing:
            raise IFEvalDataError(f"{where}: missing fields {missing}")
        if isinstance(key, bool) or not isinstance(key, int):
            raise IFEvalDataError(f"{where}: 'key' must be an int")
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise IFEvalDataError(f"{where}: 'prompt' must be a non-empty string")
        ids, kwargs_list = row["instruction_id_list"], row["kwargs"]
        if isinstance(ids, str) or not isinstance(ids, Sequence) or not ids:
            raise IFEvalDataError(f"{where}: 'instruction_id_list' must be a non-empty list")
        if isinstance(kwargs_list, (str, Mapping)) or not isinstance(kwargs_list, Sequence):
            raise IFEvalDataError(f"{where}: 'kwargs' must be a list of dicts")
        if len(kwargs_list) != len(ids):
            raise IFEvalDataError(
                f"{where}: {len(ids)} instruction ids but {len(kwargs_list)} kwargs dicts"
            )
        for position, (instruction_id, kwargs) in enumerate(zip(ids, kwargs_list, strict=True)):
            problems = _instruction_problems(instruction_id, kwargs)
            if problems:
                raise IFEvalDataError(
                    f"{where}, instruction {position} {instruction_id!r}: {'; '.join(problems)}"
                )


def _normalize_row(row: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(row)
    kwargs_list = row.get("kwargs")
    if isinstance(kwargs_list, Sequence) and not isinstance(kwargs_list, (str, bytes)):
        out["kwargs"] = [
            normalize_kwargs(k) if isinstance(k, Mapping) or k is None else k
            for k in kwargs_list
        ]
    if isinstance(row.get("instruction_id_list"), tuple):
        out["instruction_id_list"] = list(row["instruction_id_list"])
    return out


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise IFEvalDataError(f"{path}:{lineno}: invalid JSON ({err})") from err
    return rows


def _hub_offline() -> bool:
    return any(
        os.environ.get(var, "").lower() in ("1", "true", "yes", "on")
        for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def load_ifeval_rows(path_or_name: str | os.PathLike, split: str = "train") -> list[dict]:
    """Load, normalise (drop None kwargs) and validate IFEval rows.

    ``path_or_name`` is one of: a ``.jsonl`` / ``.json`` file (one row per line); a folder
    holding ``{split}.jsonl``; a folder written by ``datasets``' ``save_to_disk`` (a
    ``DatasetDict``, indexed by ``split``, or a ``Dataset``); otherwise a hub name such as
    ``google/IFEval``, loaded with ``datasets.load_dataset`` (needs network; refused when
    ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` is set).
    """
    path = Path(path_or_name)
    if path.is_file():
        rows = _read_jsonl(path)
    elif path.is_dir():
        if (path / f"{split}.jsonl").is_file():
            rows = _read_jsonl(path / f"{split}.jsonl")
        elif (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
            import datasets

            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise IFEvalDataError(
                        f"{path}: no split {split!r} (has {sorted(loaded)})"
                    )
                loaded = loaded[split]
            rows = loaded.to_list()
        else:
            raise IFEvalDataError(
                f"{path}: no {split}.jsonl and not a datasets save_to_disk folder "
                f"(contains {sorted(p.name for p in path.iterdir())})"
            )
    else:
        if _hub_offline():
            raise RuntimeError(
                f"{str(path_or_name)!r} is not a local file or folder, and the hub is "
                "offline (HF_DATASETS_OFFLINE/HF_HUB_OFFLINE): cannot load it"
            )
        import datasets

        rows = datasets.load_dataset(str(path_or_name), split=split).to_list()
    if not rows:
        raise IFEvalDataError(f"{path_or_name!s} (split {split!r}): no rows")
    rows = [_normalize_row(r) if isinstance(r, Mapping) else r for r in rows]
    validate_rows(rows)
    return rows


# --------------------------------------------------------------------------------------
# Strict / loose evaluation and aggregation
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

    @property
    def prompt_level_strict(self) -> bool:
        return all(self.strict)

    @property
    def prompt_level_loose(self) -> bool:
        return all(self.loose)

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
        raise IFEvalDataError("empty instruction id list")
    if kwargs_list is None:
        kwargs_list = [{}] * len(instruction_ids)
    if len(kwargs_list) != len(instruction_ids):
        raise IFEvalDataError(
            f"{len(instruction_ids)} instruction ids but {len(kwargs_list)} kwargs dicts"
        )
    variants = [v for v in loose_variants(response) if v.strip()]
    strict, loose = [], []
    for instruction_id, kwargs in zip(instruction_ids, kwargs_list, strict=True):
        problems = _instruction_problems(instruction_id, kwargs)
        if problems:
            raise IFEvalDataError(f"instruction {instruction_id!r}: {'; '.join(problems)}")
        spec, kw = REGISTRY[instruction_id], normalize_kwargs(kwargs)
        followed = bool(response.strip()) and spec(response, **kw)
        strict.append(followed)
        loose.append(followed or any(spec(v, **kw) for v in variants))
    return IFEvalResult(instruction_ids, strict, loose)


def aggregate(results: Iterable[IFEvalResult]) -> dict[str, float]:
    """Dataset-level IFEval accuracies.

    Prompt level: fraction of responses that follow all their instructions. Instruction
    level: followed instructions / all instructions (pooled over responses, as in IFEval).
    """
    results = list(results)
    if not results:
        raise ValueError("aggregate() needs at least one result")
    n_inst = sum(len(r.strict) for r in results)
    return {
        "prompt_level_strict_acc": sum(r.prompt_level_strict for r in results) / len(results),
        "inst_level_strict_acc": sum(sum(r.strict) for r in results) / n_inst,
        "prompt_level_loose_acc": sum(r.prompt_level_loose for r in results) / len(results),
        "inst_level_loose_acc": sum(sum(r.loose) for r in results) / n_inst,
    }


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

_FORMAT_RE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TAG_RE = re.compile(r"</?(?:think|answer)>")


def format_ok(response: str) -> bool:
    """True iff the response is exactly ``<think>...</think>`` then ``<answer>...</answer>``
    (whitespace around allowed, no other text, no extra or nested tags)."""
    match = _FORMAT_RE.fullmatch(response)
    return bool(match) and not any(_TAG_RE.search(g) for g in match.groups())


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
            raise ValueError(f"unknown reward weights {unknown} (known: {list(out)})")
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
    out["format_ok"] = float(format_ok(response_text))
    out["reward"] = sum(w[name] * out[key] for name, key in _WEIGHT_TO_KEY.items())
    out["strict"] = result.strict
    out["loose"] = result.loose
    return out


# --------------------------------------------------------------------------------------
# TorchRL transform and env
# --------------------------------------------------------------------------------------


def _python_list(value: Any) -> list:
    if isinstance(value, (NonTensorData, NonTensorStack)):
        value = value.tolist()
    return list(value)


class IFEvalReward(Transform):
    """IFEval reward transform for ``IFEvalEnv`` / ``DatasetChatEnv`` based envs.

    In ``_step`` it reads, for each env of the batch, the last message of
    ``("history", "full")`` (history mode; ``("text", "response")`` in text mode, decoded
    ``("tokens", "response")`` in tokens mode) and the row's ``instruction_id_list`` and
    ``kwargs`` fields (the names ``IFEvalEnv`` uses), and writes :func:`ifeval_reward`'s
    ``reward`` plus ``prompt_level_strict_acc``, ``inst_level_strict_acc``,
    ``prompt_level_loose_acc``, ``inst_level_loose_acc``, ``format_ok`` and ``success``
    (= prompt-level strict), each of shape ``batch + (1, 1)`` like ``GSM8KRewardParser``.
    A ``reward`` already present (another reward transform) is added to, not overwritten.

    Args:
        tokenizer: used to decode tokens mode and to know the EOS token to strip.
        weights: reward weights (see :data:`DEFAULT_REWARD_WEIGHTS`), a plain dict.
        instruction_ids_key, kwargs_key: data field names.
        eos_token: stripped from the end of responses; defaults to ``tokenizer.eos_token``.
        input_mode: ``"history"``, ``"text"`` or ``"tokens"``; defaults to the parent env's.
    """

    OUT_KEYS = ("reward", *ACCURACY_KEYS, "format_ok", "success")

    def __init__(
        self,
        tokenizer=None,
        weights: Mapping[str, float] | None = None,
        *,
        instruction_ids_key: str = "instruction_id_list",
        kwargs_key: str = "kwargs",
        eos_token: str | None = None,
        input_mode: Literal["history", "text", "tokens"] | None = None,
    ):
        super().__init__(in_keys=[instruction_ids_key, kwargs_key], out_keys=list(self.OUT_KEYS))
        self.tokenizer = tokenizer
        self.weights = resolve_weights(weights)
        self.instruction_ids_key = instruction_ids_key
        self.kwargs_key = kwargs_key
        if eos_token is None and tokenizer is not None:
            eos_token = tokenizer.eos_token
        self.eos_token = eos_token
        self._input_mode = input_mode

    @property
    def input_mode(self) -> str:
        if self._input_mode is not None:
            return self._input_mode
        parent = self.parent
        base_env = getattr(parent, "base_env", None) if parent is not None else None
        return getattr(base_env, "input_mode", "history")

    def _responses(self, tensordict: TensorDictBase) -> list[str]:
        mode = self.input_mode
        batch = tensordict.batch_size[0]
        if mode == "history":
            full = tensordict.get(("history", "full"))
            texts = []
            for i in range(batch):
                content = full[i][-1].content
                texts.append(content.data if isinstance(content, NonTensorData) else content)
        elif mode == "text":
            texts = _python_list(tensordict[("text", "response")])
        elif mode == "tokens":
            if self.tokenizer is None:
                raise RuntimeError("IFEvalReward needs a tokenizer in tokens mode")
            tokens = tensordict.get(("tokens", "response"))
            rows = tokens.unbind(0) if isinstance(tokens, torch.Tensor) else tokens
            texts = [
                self.tokenizer.decode(torch.as_tensor(t).tolist(), skip_special_tokens=True)
                for t in rows
            ]
        else:
            raise ValueError(f"unknown input_mode {mode!r}")
        cleaned = []
        for text in texts:
            text = text or ""
            for suffix in filter(None, (self.eos_token, "<|im_end|>")):
                text = text.rstrip().removesuffix(suffix)
            cleaned.append(text)
        return cleaned

    def _field(self, tensordict, next_tensordict, key) -> list:
        for td in (tensordict, next_tensordict):
            if key in td.keys():
                return _python_list(td[key])
        raise KeyError(
            f"IFEvalReward: no {key!r} in the tensordict; build the env with "
            "IFEvalEnv / make_ifeval_env so that the row fields are carried"
        )

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        if next_tensordict.batch_dims > 1:
            with tensordict.view(-1) as td_view, next_tensordict.view(-1) as next_view:
                self._step(td_view, next_view)
            return next_tensordict
        if next_tensordict.batch_dims == 0:
            raise ValueError("IFEvalReward expects a batched env (batch_size=(num_envs,))")
        texts = self._responses(tensordict)
        ids_batch = self._field(tensordict, next_tensordict, self.instruction_ids_key)
        kwargs_batch = self._field(tensordict, next_tensordict, self.kwargs_key)
        scores = [
            ifeval_reward(text, _python_list(ids), _python_list(kws), self.weights)
            for text, ids, kws in zip(texts, ids_batch, kwargs_batch, strict=True)
        ]
        shape = next_tensordict.batch_size + (1, 1)
        device = next_tensordict.device
        dtype = torch.get_default_dtype()
        values = {
            key: torch.tensor([s[key] for s in scores], dtype=dtype, device=device).view(shape)
            for key in ("reward", *ACCURACY_KEYS, "format_ok")
        }
        values["success"] = values["prompt_level_strict_acc"] > 0.5
        previous = next_tensordict.get("reward", None)
        if previous is not None:
            values["reward"] = values["reward"] + previous.view(shape).to(dtype)
        next_tensordict.update(values)
        return next_tensordict

    def transform_reward_spec(self, reward_spec: Composite) -> Composite:
        shape = reward_spec.shape + (1, 1)
        device = reward_spec.device
        dtype = torch.get_default_dtype()
        specs = {key: Unbounded(shape, dtype=dtype, device=device) for key in self.OUT_KEYS}
        specs["success"] = Unbounded(shape, dtype=torch.bool, device=device)
        reward_spec.update(Composite(specs, shape=reward_spec.shape, device=device))
        return reward_spec


def collate_ifeval_rows(batch: Sequence[Mapping[str, Any]]) -> TensorDict:
    """Collate rows into the fields ``IFEvalEnv`` uses: ``key`` (int64), ``query`` (the
    prompt) and ``instruction_id_list`` / ``kwargs`` (one python list per row)."""
    return TensorDict(
        {
            "key": torch.tensor([int(r["key"]) for r in batch], dtype=torch.int64),
            "query": NonTensorStack(*[NonTensorData(r["prompt"]) for r in batch]),
            "instruction_id_list": NonTensorStack(
                *[NonTensorData(list(r["instruction_id_list"])) for r in batch]
            ),
            "kwargs": NonTensorStack(
                *[NonTensorData([normalize_kwargs(k) for k in r["kwargs"]]) for r in batch]
            ),
        },
        batch_size=[len(batch)],
    )


@functools.cache
def _validated_env_class(system_prompt: str | None = None):
    from torchrl.envs.llm import IFEvalEnv

    from grpo.envs import PositionedLoader

    class ValidatedIFEvalEnv(IFEvalEnv):
        """``IFEvalEnv`` whose ``dataset`` is a list of already validated rows."""

        # IFEvalEnv takes no system_prompt argument; a small model may need a shorter one
        SYSTEM_PROMPT = IFEvalEnv.SYSTEM_PROMPT if system_prompt is None else system_prompt

        @staticmethod
        def _dataloader_factory(dataset, name, split, seed, batch_size_dl, shuffle, collate_fn):
            if seed is None:
                seed = int(torch.empty((), dtype=torch.int64).random_().item())
            return PositionedLoader(dataset, seed=seed, batch_size_dl=batch_size_dl, shuffle=shuffle,
                                    collate_fn=collate_ifeval_rows)

    return ValidatedIFEvalEnv


def make_ifeval_env(
    path_or_name: str | os.PathLike,
    split: str = "train",
    *,
    tokenizer=None,
    weights: Mapping[str, float] | None = None,
    num_envs: int = 1,
    repeats: int | None = None,
    batch_size_dl: int = 1,
    seed: int | None = None,
    shuffle: bool = True,
    input_mode: Literal["history", "text", "tokens"] = "history",
    max_steps: int = 1,
    system_prompt: str | None = None,
    **env_kwargs: Any,
):
    """An ``IFEvalEnv`` on rows loaded and validated by :func:`load_ifeval_rows`, with
    :class:`IFEvalReward` (instead of TorchRL's ``IfEvalScorer``) appended.

    Requires ``tensordict.set_list_to_stack(True).set()`` beforehand (TorchRL's rule).
    """
    rows = load_ifeval_rows(path_or_name, split)
    env = _validated_env_class(system_prompt)(
        dataset=rows,
        shuffle=shuffle,
        num_envs=num_envs,
        repeats=repeats,
        batch_size_dl=batch_size_dl,
        seed=seed,
        tokenizer=tokenizer,
        input_mode=input_mode,
        max_steps=max_steps,
        compute_reward=False,
        **env_kwargs,
    )
    env.append_transform(IFEvalReward(tokenizer=tokenizer, weights=weights))
    return env
