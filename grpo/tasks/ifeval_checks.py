"""IFEval's verifiable instructions: one offline checker per instruction id, its kwargs, validation.

The checkers replace TorchRL 0.14.1's (``torchrl.envs.llm.IfEvalScorer``), which are not
usable as a training reward:

1. ``length_constraints:number_sentences`` and ``change_case:capital_word_frequency`` call
   nltk's punkt model, which needs the ``punkt_tab`` data at run time. Here they use the
   offline splitter and word tokenizer of :mod:`grpo.tasks.ifeval_text`.
2. Missing kwargs are silently replaced by *random* values (thresholds, relations,
   keywords), and the scorer drops every falsy kwarg (``if v``), so ``0`` also becomes
   random; ``keywords:letter_frequency`` replaces any ``letter`` that is not ``a-z`` by a
   random letter, which hits real IFEval rows (``"letter": "#"``, ``"!"``). The reward is then
   non-deterministic. Here kwargs are validated (:func:`validate_rows`) and never invented.
3. ``langdetect`` is used unseeded (non-deterministic on short text) and a detection failure
   counts as *followed*. Here detection is seeded and failure counts as not followed (a
   response with no letters must not earn a language reward). ``change_case:english_capital``
   runs langdetect on the all-caps text, where langdetect ignores every word (it skips
   all-caps words as acronyms); here it runs on the lowercased text.
4. Keyword arguments are interpolated into regexes unescaped (a keyword with ``+`` or ``(``
   raises or mismatches). Here they are escaped.

Semantics otherwise follow the IFEval paper / reference implementation. Deliberate
differences are listed in ``docs/ifeval.md``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from grpo.process.errors import DataError
from grpo.tasks.ifeval_text import count_sentences, count_words, is_language, supported_languages, word_tokens


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
    return is_language(response, language)


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
    return response.isupper() and is_language(response.lower(), "en")


def _english_lowercase(response: str) -> bool:
    return response.islower() and is_language(response, "en")


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
        unknown = sorted(set(kwargs) - set(self.accepted))
        if unknown:
            out.append(f"unknown kwargs {unknown} (accepted: {list(self.accepted)})")
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
        raise DataError(f"instruction {instruction_id!r}: {'; '.join(problems)}")
    if not response.strip():
        return False
    return REGISTRY[instruction_id](response, **normalize_kwargs(kwargs))


# --------------------------------------------------------------------------------------
# Row validation
# --------------------------------------------------------------------------------------

ROW_FIELDS = ("key", "prompt", "instruction_id_list", "kwargs")


def validate_rows(rows: Sequence[Mapping[str, Any]], *, source: str = "") -> None:
    """Raise :class:`DataError` on the first malformed row.

    Each row needs ``key`` (int), ``prompt`` (str), ``instruction_id_list`` (non-empty list
    of supported ids) and ``kwargs`` (list of dicts, one per instruction; None-valued
    entries mean unset). The message starts with ``source`` (which file and split) and
    names the row index, its key and the instruction id.
    """
    for index, row in enumerate(rows):
        key = row.get("key") if isinstance(row, Mapping) else None
        where = f"{source}row {index} (key={key!r})"
        if not isinstance(row, Mapping):
            raise DataError(f"{where}: expected a dict, got {type(row).__name__}")
        missing = [f for f in ROW_FIELDS if f not in row]
        if missing:
            raise DataError(f"{where}: missing fields {missing}")
        if isinstance(key, bool) or not isinstance(key, int):
            raise DataError(f"{where}: 'key' must be an int")
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise DataError(f"{where}: 'prompt' must be a non-empty string")
        ids, kwargs_list = row["instruction_id_list"], row["kwargs"]
        if isinstance(ids, str) or not isinstance(ids, Sequence) or not ids:
            raise DataError(f"{where}: 'instruction_id_list' must be a non-empty list")
        if isinstance(kwargs_list, (str, Mapping)) or not isinstance(kwargs_list, Sequence):
            raise DataError(f"{where}: 'kwargs' must be a list of dicts")
        if len(kwargs_list) != len(ids):
            raise DataError(
                f"{where}: {len(ids)} instruction ids but {len(kwargs_list)} kwargs dicts"
            )
        for position, (instruction_id, kwargs) in enumerate(zip(ids, kwargs_list, strict=True)):
            problems = _instruction_problems(instruction_id, kwargs)
            if problems:
                raise DataError(
                    f"{where}, instruction {position} {instruction_id!r}: {'; '.join(problems)}"
                )

