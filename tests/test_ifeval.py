"""Tests for grpo/ifeval.py: checkers, strict/loose, aggregation, validation, loading,
reward and the TorchRL env transform. No network, no nltk data."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import tensordict
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from anywhere, without installing the package
    sys.path.insert(0, str(ROOT))

from grpo import ifeval  # noqa: E402
from grpo.ifeval import (  # noqa: E402
    DEFAULT_REWARD_WEIGHTS,
    REGISTRY,
    SUPPORTED_INSTRUCTION_IDS,
    IFEvalDataError,
    IFEvalResult,
    IFEvalReward,
    aggregate,
    check_instruction,
    count_sentences,
    evaluate_response,
    extract_answer,
    format_ok,
    ifeval_reward,
    load_ifeval_rows,
    loose_variants,
    make_ifeval_env,
    split_sentences,
    validate_rows,
)

DATA = ROOT / "data" / "ifeval_tiny"

LT, AL = "less than", "at least"

# (instruction id, kwargs, response, expected strict result, same result in TorchRL's checker?)
# The last flag is False where TorchRL cannot run offline (nltk punkt), is random
# (unseeded langdetect, random letter) or where we deviate on purpose.
CASES = [
    ("keywords:existence", {"keywords": ["cat", "Blue"]}, "The blue cat sat.", True, True),
    ("keywords:existence", {"keywords": ["cat", "Blue"]}, "The blue dog sat.", False, True),
    ("keywords:frequency", {"keyword": "war", "frequency": 2, "relation": AL}, "War is war.", True, True),
    ("keywords:frequency", {"keyword": "war", "frequency": 2, "relation": AL}, "War is bad.", False, True),
    ("keywords:frequency", {"keyword": "sarah", "frequency": 2, "relation": LT}, "Sarah is here.", True, True),
    ("keywords:frequency", {"keyword": "sarah", "frequency": 2, "relation": LT}, "Sarah met sarah.", False, True),
    ("keywords:forbidden_words", {"forbidden_words": ["rock"]}, "Rocky hills are great.", True, True),
    ("keywords:forbidden_words", {"forbidden_words": ["rock"]}, "We ROCK the stage.", False, True),
    ("keywords:letter_frequency", {"letter": "e", "let_frequency": 3, "let_relation": LT}, "A cat sat.", True, True),
    (
        "keywords:letter_frequency",
        {"letter": "e", "let_frequency": 3, "let_relation": LT},
        "Eleven trees.",
        False,
        True,
    ),
    ("keywords:letter_frequency", {"letter": "#", "let_frequency": 2, "let_relation": AL}, "#fun #sun", True, False),
    ("keywords:letter_frequency", {"letter": "#", "let_frequency": 2, "let_relation": AL}, "#fun sun", False, False),
    (
        "language:response_language",
        {"language": "fr"},
        "Le chat est sur la table et il dort tranquillement.",
        True,
        False,
    ),
    ("language:response_language", {"language": "fr"}, "The cat is on the table and it sleeps quietly.", False, False),
    ("language:response_language", {"language": "fr"}, "12345 !!! 678", False, False),  # undetectable
    ("language:response_language", {"language": "zh"}, "今天天气很好，我们去公园散步吧。", True, False),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 3, "relation": LT},
        "Dr. Smith came. He left.",
        True,
        False,
    ),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": LT}, "One. Two! Three?", False, False),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": AL}, "Hi there. Bye now!", True, False),
    (
        "length_constraints:number_sentences",
        {"num_sentences": 2, "relation": AL},
        "Only one sentence\nover two lines",
        False,
        False,
    ),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First part.\n***\nSecond part.", True, True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "First.\n***\n\n***\nSecond.", False, True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "Only one paragraph.", False, True),
    ("length_constraints:number_words", {"num_words": 5, "relation": LT}, "Four words right here.", True, True),
    ("length_constraints:number_words", {"num_words": 5, "relation": LT}, "One two three four five.", False, True),
    ("length_constraints:number_words", {"num_words": 5, "relation": AL}, "One two three four five.", True, True),
    ("length_constraints:number_words", {"num_words": 5, "relation": AL}, "Four words right here.", False, True),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 3, "nth_paragraph": 2, "first_word": "president"},
        'Aliens came.\n\n"President, hi" said Bob.\n\nThe end.',
        True,
        True,
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 3, "nth_paragraph": 2, "first_word": "president"},
        "Aliens came.\n\nThe president spoke.\n\nThe end.",
        False,
        True,
    ),
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 3, "nth_paragraph": 2, "first_word": "president"},
        "Aliens came.\n\nPresident Bob spoke.",
        False,
        True,
    ),
    # Extra blank lines do not shift the paragraph index here (they do in the reference code).
    (
        "length_constraints:nth_paragraph_first_word",
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "bob"},
        "Aliens came.\n\n\n\nBob spoke.",
        True,
        False,
    ),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name], at [address].", True, True),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name].", False, True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hello.\nP.S. see you", True, True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hello. See you soon.", False, True),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Hi\nP.P.S. bye", True, True),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Hi\nP.S. bye", False, True),
    ("detectable_content:postscript", {"postscript_marker": "Note:"}, "Hi\nnote: bye", True, True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "Intro\n* one\n* two", True, True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* one\n* two\n- three", False, True),
    ("detectable_format:constrained_response", {}, "I think so. My answer is yes.", True, True),
    ("detectable_format:constrained_response", {}, "Yes, definitely.", False, True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and **two**", True, True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* and ** **", False, True),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nfoo\nSection 2\nbar",
        True,
        True,
    ),
    (
        "detectable_format:multiple_sections",
        {"section_spliter": "Section", "num_sections": 2},
        "Section 1\nfoo\nbar",
        False,
        True,
    ),
    ("detectable_format:json_format", {}, '```json\n{"a": 1}\n```', True, True),
    ("detectable_format:json_format", {}, 'Here: {"a": 1}', False, True),
    ("detectable_format:title", {}, "<<My Poem>>\nroses", True, True),
    ("detectable_format:title", {}, "<< >> roses <My Poem>", False, True),
    ("combination:two_responses", {}, "Answer one.\n******\nAnswer two.", True, True),
    ("combination:two_responses", {}, "Same.\n******\nSame.", False, True),
    ("combination:two_responses", {}, "A\n******\n\n******\nB", False, True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem."}, "write a poem. Roses are red.", True, True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem."}, "Sure! Write a poem. Roses.", False, True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, '"Here you go. Any other questions?"', True, True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Any other questions? Bye.", False, True),
    ("startend:quotation", {}, '"hello there"', True, True),
    ("startend:quotation", {}, '"hello there', False, True),
    ("change_case:english_capital", {}, "THE CAT SLEEPS ALL DAY LONG IN THE WARM SUN.", True, False),
    ("change_case:english_capital", {}, "THE CAT sleeps all day long.", False, False),
    ("change_case:english_capital", {}, "LE CHAT EST SUR LA TABLE ET IL DORT TRANQUILLEMENT.", False, False),
    # langdetect on the raw all-caps text says "so" (Somali); we detect on the lowercased text
    ("change_case:english_capital", {}, "HELLO WORLD", True, False),
    ("change_case:english_lowercase", {}, "the cat sleeps all day long in the warm sun.", True, False),
    ("change_case:english_lowercase", {}, "The cat sleeps all day long in the warm sun.", False, False),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 3, "capital_relation": AL},
        "I LOVE THE sun.",
        True,
        False,
    ),
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 3, "capital_relation": AL},
        "I love The sun.",
        False,
        False,
    ),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": LT}, "We go NOW.", True, False),
    # nltk word tokens: DON'T -> DO, N'T: two all-caps tokens.
    (
        "change_case:capital_word_frequency",
        {"capital_frequency": 2, "capital_relation": LT},
        "We DON'T go.",
        False,
        False,
    ),
    ("punctuation:no_comma", {}, "No commas here.", True, True),
    ("punctuation:no_comma", {}, "Yes, commas.", False, True),
]


def _case_id(case):
    return f"{case[0]}-{'pass' if case[3] else 'fail'}-{case[2][:20]!r}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_checker_cases(case):
    instruction_id, kwargs, response, expected, _ = case
    assert check_instruction(instruction_id, response, kwargs) is expected


def test_every_supported_id_has_a_passing_and_a_failing_case():
    assert len(SUPPORTED_INSTRUCTION_IDS) == 25
    passing = {c[0] for c in CASES if c[3]}
    failing = {c[0] for c in CASES if not c[3]}
    assert passing == set(SUPPORTED_INSTRUCTION_IDS)
    assert failing == set(SUPPORTED_INSTRUCTION_IDS)


def test_parity_with_torchrl_checkers():
    """Where TorchRL's (reference) checker is deterministic and runs offline, ours agree."""
    registry = pytest.importorskip("torchrl.envs.llm.reward.ifeval._instructions_registry")
    checked = 0
    for instruction_id, kwargs, response, expected, parity in CASES:
        if not parity:
            continue
        instruction = registry.INSTRUCTION_DICT[instruction_id](instruction_id)
        instruction.build_description(**kwargs)
        assert instruction.check_following(response) is expected, (instruction_id, response)
        checked += 1
    assert checked >= 45


def test_registry_specs():
    for instruction_id, spec in REGISTRY.items():
        assert spec.id == instruction_id
        assert set(spec.required) <= set(spec.accepted)
    assert REGISTRY["length_constraints:number_words"].required == ("num_words", "relation")
    assert REGISTRY["punctuation:no_comma"].accepted == ()


def test_empty_response_follows_nothing():
    # forbidden_words would pass on an empty text; IFEval counts empty responses as failing.
    for response in ("", "   \n"):
        result = evaluate_response(
            response, ["keywords:forbidden_words", "punctuation:no_comma"], [{"forbidden_words": ["x"]}, {}]
        )
        assert result.strict == [False, False]
        assert result.loose == [False, False]


# ---- sentence splitting (offline replacement of nltk punkt) ----------------------------


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
    assert check_instruction(
        "change_case:capital_word_frequency",
        "A BIG DOG. IT RAN.",
        {"capital_frequency": 5, "capital_relation": "at least"},
    )
    assert check_instruction(
        "length_constraints:number_sentences", "One. Two.", {"num_sentences": 2, "relation": "at least"}
    )


def test_language_detection_is_deterministic():
    text = "i like green tea."  # short text: langdetect is unstable without a seed
    first = ifeval.detect_language(text)
    ifeval.detect_language.cache_clear()
    assert all(ifeval.detect_language(text) == first for _ in range(3))


# ---- strict vs loose -------------------------------------------------------------------


@pytest.mark.parametrize(
    "instruction_id, kwargs, response, strict, loose",
    [
        # an intro line breaks lowercase: removing the first line fixes it
        (
            "change_case:english_lowercase",
            {},
            "Sure! Here it is:\nthe cat sleeps all day long in the warm sun.",
            False,
            True,
        ),
        ("detectable_format:json_format", {}, 'Here is the JSON:\n{"a": 1}', False, True),
        # a trailing line after the end phrase: removing the last line fixes it
        (
            "startend:end_checker",
            {"end_phrase": "The end."},
            "Once upon a time. The end.\nHope you liked it!",
            False,
            True,
        ),
        # markdown bold around the first word: removing * fixes it
        (
            "length_constraints:nth_paragraph_first_word",
            {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "summary"},
            "Intro text.\n\n**Summary** of it.",
            False,
            True,
        ),
        ("startend:quotation", {}, 'Here:\n"quoted text"\nDone.', False, True),
        # a comma in the middle cannot be removed by any variant
        ("punctuation:no_comma", {}, "Intro\nyes, a comma\nend", False, False),
        ("punctuation:no_comma", {}, "no comma at all", True, True),
    ],
)
def test_strict_vs_loose(instruction_id, kwargs, response, strict, loose):
    result = evaluate_response(response, [instruction_id], [kwargs])
    assert result.strict == [strict]
    assert result.loose == [loose]


def test_loose_variants():
    variants = loose_variants("first\n*mid*\nlast")
    assert variants[:4] == ["first\n*mid*\nlast", "*mid*\nlast", "first\n*mid*", "*mid*"]
    assert variants[4:] == ["first\nmid\nlast", "mid\nlast", "first\nmid", "mid"]


# ---- aggregation on a fixed set computed by hand ---------------------------------------

AGG_SET = [
    # (instruction ids, kwargs, response, strict, loose)
    (
        ["punctuation:no_comma", "change_case:english_lowercase"],
        [{}, {}],
        "the cat sleeps all day long in the warm sun.",
        [True, True],
        [True, True],
    ),
    (
        ["detectable_format:json_format", "punctuation:no_comma"],
        [{}, {}],
        'Here you go:\n{"a": 1}',
        [False, True],
        [True, True],
    ),
    (
        ["keywords:existence", "startend:quotation"],
        [{"keywords": ["blue"]}, {}],
        "The sky is grey.",
        [False, False],
        [False, False],
    ),
    (
        ["startend:end_checker"],
        [{"end_phrase": "The end."}],
        "Once upon a time. The end.\nHope you liked it!",
        [False],
        [True],
    ),
]


def test_aggregate_by_hand():
    results = []
    for ids, kwargs, response, strict, loose in AGG_SET:
        result = evaluate_response(response, ids, kwargs)
        assert (result.strict, result.loose) == (strict, loose)
        results.append(result)
    agg = aggregate(results)
    assert agg["prompt_level_strict_acc"] == pytest.approx(1 / 4)  # only the first prompt
    assert agg["prompt_level_loose_acc"] == pytest.approx(3 / 4)  # all but the third
    assert agg["inst_level_strict_acc"] == pytest.approx(3 / 7)  # 2 + 1 + 0 + 0 of 7
    assert agg["inst_level_loose_acc"] == pytest.approx(5 / 7)  # 2 + 2 + 0 + 1 of 7
    assert results[1].accuracies() == {
        "prompt_level_strict_acc": 0.0,
        "inst_level_strict_acc": 0.5,
        "prompt_level_loose_acc": 1.0,
        "inst_level_loose_acc": 1.0,
    }


def test_aggregate_needs_results():
    with pytest.raises(ValueError):
        aggregate([])
    assert isinstance(evaluate_response("x", ["punctuation:no_comma"]), IFEvalResult)
    with pytest.raises(IFEvalDataError):
        evaluate_response("x", [])


# ---- reward ----------------------------------------------------------------------------

JSON_IDS = ["detectable_format:json_format", "punctuation:no_comma"]


def test_reward_formula_with_tags():
    out = ifeval_reward('<think>hmm, json</think>\n<answer>Here you go:\n{"a": 1}</answer>', JSON_IDS, [{}, {}])
    # 0.4*0 + 0.3*0.5 + 0.2*1 + 0.1*1 + 0.1*format(1); the comma in <think> is not checked
    assert out["reward"] == pytest.approx(0.55)
    assert out["format_ok"] == 1.0
    assert out["strict"] == [False, True] and out["loose"] == [True, True]


def test_reward_without_tags_checks_whole_response():
    out = ifeval_reward('Here you go:\n{"a": 1}', JSON_IDS, [{}, {}])
    assert out["format_ok"] == 0.0
    assert out["reward"] == pytest.approx(0.45)
    # no <answer>: the <think> text is part of what is checked
    out = ifeval_reward("<think>a, b</think> all good", ["punctuation:no_comma"], [{}])
    assert out["strict"] == [False] and out["format_ok"] == 0.0


def test_reward_custom_weights_and_typos():
    weights = {"prompt_strict": 1.0, "inst_strict": 0.0, "prompt_loose": 0.0, "inst_loose": 0.0, "format": 2.0}
    out = ifeval_reward("<think>x</think><answer>no comma</answer>", ["punctuation:no_comma"], [{}], weights)
    assert out["reward"] == pytest.approx(3.0)
    out = ifeval_reward("no comma", ["punctuation:no_comma"], [{}], {"format": 0.0})
    assert out["reward"] == pytest.approx(sum(DEFAULT_REWARD_WEIGHTS.values()) - DEFAULT_REWARD_WEIGHTS["format"])
    with pytest.raises(ValueError, match="prompt_strcit"):
        ifeval_reward("x", ["punctuation:no_comma"], [{}], {"prompt_strcit": 1.0})


@pytest.mark.parametrize(
    "response, ok",
    [
        ("<think>a</think><answer>b</answer>", True),
        ("  <think>\na\n</think>\n\n<answer>\nb\n</answer>\n", True),
        ("<answer>b</answer><think>a</think>", False),
        ("<think>a</think>", False),
        ("<answer>b</answer>", False),
        ("text <think>a</think><answer>b</answer>", False),
        ("<think>a</think><answer>b</answer> trailing", False),
        ("<think>a</think><answer>b</answer><answer>c</answer>", False),
        ("<think>a<think>x</think><answer>b</answer>", False),
    ],
)
def test_format_ok(response, ok):
    assert format_ok(response) is ok


def test_extract_answer():
    assert extract_answer("<think>t</think><answer>\n hi \n</answer>") == "hi"
    assert extract_answer("<answer>unclosed") is None


# ---- validation --------------------------------------------------------------------------


def _row(key=1, ids=("punctuation:no_comma",), kwargs=({},)):
    return {"key": key, "prompt": "p", "instruction_id_list": list(ids), "kwargs": list(kwargs)}


@pytest.mark.parametrize(
    "bad_row, fragments",
    [
        (_row(7, ["foo:bar"], [{}]), ["row 1", "key=7", "'foo:bar'", "unsupported"]),
        (
            _row(8, ["length_constraints:number_words"], [{"num_words": 5, "relation": LT, "foo": 1}]),
            ["row 1", "key=8", "length_constraints:number_words", "unknown kwargs ['foo']"],
        ),
        (
            _row(9, ["length_constraints:number_words"], [{"num_words": 5}]),
            ["key=9", "length_constraints:number_words", "missing required kwargs ['relation']"],
        ),
        (
            _row(10, ["length_constraints:number_words"], [{"num_words": "5", "relation": LT}]),
            ["key=10", "'num_words'", "expected an int"],
        ),
        (
            _row(11, ["length_constraints:number_words"], [{"num_words": True, "relation": LT}]),
            ["key=11", "expected an int"],
        ),
        (
            _row(12, ["keywords:frequency"], [{"keyword": "x", "frequency": 2, "relation": "more than"}]),
            ["key=12", "keywords:frequency", "'relation'", "must be one of"],
        ),
        (
            _row(13, ["keywords:letter_frequency"], [{"letter": "ab", "let_frequency": 2, "let_relation": LT}]),
            ["key=13", "single character"],
        ),
        (_row(14, ["keywords:existence"], [{"keywords": "cat"}]), ["key=14", "list of strings"]),
        (_row(15, ["language:response_language"], [{"language": "xx"}]), ["key=15", "not a langdetect code"]),
        (
            _row(
                16,
                ["length_constraints:nth_paragraph_first_word"],
                [{"num_paragraphs": 2, "nth_paragraph": 3, "first_word": "a"}],
            ),
            ["key=16", "nth_paragraph (3)"],
        ),
        (
            _row(17, ["punctuation:no_comma", "punctuation:no_comma"], [{}]),
            ["key=17", "2 instruction ids but 1 kwargs"],
        ),
        (
            _row(18, ["punctuation:no_comma", "detectable_format:title"], [{}, {"title": "x"}]),
            ["key=18", "instruction 1 'detectable_format:title'", "unknown kwargs ['title']"],
        ),
        (
            {"key": 19, "prompt": "p", "instruction_id_list": ["punctuation:no_comma"]},
            ["key=19", "missing fields ['kwargs']"],
        ),
        (_row("a"), ["key='a'", "'key' must be an int"]),
        (_row(20, [], []), ["key=20", "non-empty list"]),
    ],
)
def test_validate_rows_errors(bad_row, fragments):
    with pytest.raises(IFEvalDataError) as info:
        validate_rows([_row(), bad_row])
    for fragment in fragments:
        assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_validate_rows_accepts_hub_format_none_entries():
    hub_kwargs = {name: None for name in ("num_words", "relation", "keywords", "language", "letter")}
    rows = [
        _row(1, ["length_constraints:number_words"], [{**hub_kwargs, "num_words": 5, "relation": LT}]),
        _row(2, ["punctuation:no_comma", "language:response_language"], [hub_kwargs, {**hub_kwargs, "language": "zh"}]),
        _row(3, ["keywords:letter_frequency"], [{"letter": "#", "let_frequency": 4, "let_relation": AL}]),
    ]
    validate_rows(rows)  # does not raise
    # None-valued entries are unset at evaluation time too
    assert evaluate_response("a b c", rows[0]["instruction_id_list"], rows[0]["kwargs"]).strict == [True]


# ---- loading -----------------------------------------------------------------------------


def test_shipped_data_loads():
    train = load_ifeval_rows(DATA, "train")
    test = load_ifeval_rows(DATA / "test.jsonl")
    assert len(train) == 64 and len(test) == 32
    keys = [r["key"] for r in train + test]
    assert len(set(keys)) == len(keys)
    assert {r["prompt"] for r in train}.isdisjoint({r["prompt"] for r in test})


def test_load_folder_file_and_errors(tmp_path):
    rows = [_row(1), _row(2, ["length_constraints:number_words"], [{"num_words": 3, "relation": LT, "keywords": None}])]
    (tmp_path / "val.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    loaded = load_ifeval_rows(tmp_path, "val")
    assert loaded[1]["kwargs"] == [{"num_words": 3, "relation": LT}]  # None dropped
    assert load_ifeval_rows(tmp_path / "val.jsonl") == loaded
    with pytest.raises(IFEvalDataError, match="no train.jsonl"):
        load_ifeval_rows(tmp_path, "train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_row(1)) + "\n" + json.dumps(_row(5, ["nope:nope"], [{}])) + "\n")
    with pytest.raises(IFEvalDataError, match=r"row 1 \(key=5\).*nope:nope"):
        load_ifeval_rows(bad)


def test_load_saved_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    hub_kwargs = {"num_words": None, "relation": None, "keywords": None}
    rows = [
        {"key": 1, "prompt": "p1", "instruction_id_list": ["punctuation:no_comma"], "kwargs": [hub_kwargs]},
        {
            "key": 2,
            "prompt": "p2",
            "instruction_id_list": ["length_constraints:number_words"],
            "kwargs": [{**hub_kwargs, "num_words": 4, "relation": AL}],
        },
    ]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    loaded = load_ifeval_rows(tmp_path / "dd", "train")
    assert [r["kwargs"] for r in loaded] == [[{}], [{"num_words": 4, "relation": AL}]]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert load_ifeval_rows(tmp_path / "ds") == loaded


def test_hub_name_refused_offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(RuntimeError, match="offline"):
        load_ifeval_rows("google/IFEval", "train")


# ---- TorchRL env ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    tiny = ROOT / "assets" / "tiny-model"
    if (tiny / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(tiny))
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [
        "<pad>",
        "<eos>",
        "<unk>",
        "<think>",
        "</think>",
        "<answer>",
        "</answer>",
        "cats",
        "sleep",
        "all",
        "day",
        "long",
        "and",
        "purr",
        "softly",
        ".",
    ]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return tok


@pytest.fixture(scope="module", autouse=True)
def _list_to_stack():
    tensordict.set_list_to_stack(True).set()


def _step_with(env, answers):
    from torchrl.data.llm import History

    td = env.reset()
    batch = td.batch_size[0]
    response = History(role=["assistant"] * batch, content=list(answers), batch_size=(batch,)).unsqueeze(-1)
    td["history", "full"] = td["history", "prompt"].extend(response, inplace=False, dim=-1)
    return td, env.step(td)["next"]


def _values(next_td, key):
    assert next_td[key].shape == next_td.batch_size + (1, 1)
    return next_td[key].view(-1).tolist()


def test_torchrl_ifeval_env_with_ifeval_reward(tokenizer):
    from torchrl.envs.llm import IFEvalEnv

    # Rows 0 and 1 of train.jsonl: english_lowercase, then no_comma.
    env = IFEvalEnv(dataset=str(DATA), shuffle=False, seed=0, num_envs=2, tokenizer=tokenizer, compute_reward=False)
    env.append_transform(IFEvalReward(tokenizer=tokenizer))
    assert env.reward_spec["reward"].shape == (2, 1, 1)
    answer = "<think>easy</think><answer>cats sleep all day long, and purr softly.</answer>"
    td, nxt = _step_with(env, [answer, answer + tokenizer.eos_token])
    assert td["instruction_id_list"] == [["change_case:english_lowercase"], ["punctuation:no_comma"]]
    # env 0: lowercase English -> all followed: 0.4 + 0.3 + 0.2 + 0.1 + 0.1 (format)
    # env 1: has a comma -> nothing followed, only the format bonus (eos token stripped)
    assert _values(nxt, "reward") == pytest.approx([1.1, 0.1])
    assert _values(nxt, "success") == [True, False]
    assert _values(nxt, "prompt_level_loose_acc") == [1.0, 0.0]
    assert _values(nxt, "format_ok") == [1.0, 1.0]
    assert nxt["done"].all()


def test_make_ifeval_env_validates_and_rewards(tokenizer, tmp_path):
    env = make_ifeval_env(DATA, "test", tokenizer=tokenizer, shuffle=False, seed=0, num_envs=3, weights={"format": 0.5})
    # test.jsonl rows 0-2: english_lowercase; no_comma; number_words < 10.
    td, nxt = _step_with(
        env, ["<think>x</think>\n<answer>\nlemons are sour and yellow fruits that grow on trees.\n</answer>"] * 3
    )
    assert td["key"].tolist() == [2000, 2001, 2002]
    assert _values(nxt, "prompt_level_strict_acc") == [1.0, 1.0, 0.0]  # 10 words is not < 10
    assert _values(nxt, "reward") == pytest.approx([1.5, 1.5, 0.5])
    (tmp_path / "train.jsonl").write_text(json.dumps(_row(3, ["punctuation:no_coma"], [{}])) + "\n")
    with pytest.raises(IFEvalDataError, match="punctuation:no_coma"):
        make_ifeval_env(tmp_path, "train")


def _direct_td(field_name, values):
    batch = len(values)
    td = TensorDict(
        {
            "instruction_id_list": NonTensorStack(*[NonTensorData(["punctuation:no_comma"]) for _ in range(batch)]),
            "kwargs": NonTensorStack(*[NonTensorData([{}]) for _ in range(batch)]),
        },
        batch_size=[batch],
    )
    td[field_name] = values
    return td


def test_transform_text_and_tokens_modes(tokenizer):
    transform = IFEvalReward(input_mode="text")
    td = _direct_td(("text", "response"), NonTensorStack(NonTensorData("no comma here"), NonTensorData("a, b")))
    nxt = transform._step(td, TensorDict(batch_size=[2]))
    assert nxt["success"].view(-1).tolist() == [True, False]
    assert nxt["reward"].view(-1).tolist() == pytest.approx([1.0, 0.0])

    transform = IFEvalReward(tokenizer=tokenizer, input_mode="tokens")
    ids = tokenizer("cats sleep all day .", add_special_tokens=False)["input_ids"]
    td = _direct_td(("tokens", "response"), torch.tensor([ids + [tokenizer.eos_token_id]]))
    nxt = transform._step(td, TensorDict({"reward": torch.full((1, 1, 1), 0.25)}, batch_size=[1]))
    assert nxt["reward"].view(-1).tolist() == pytest.approx([1.25])  # added to an existing reward


def test_transform_multi_dim_batch():
    # GRPO-style (num_prompts, group) batches go through a flattened view.
    td = _direct_td(("text", "response"), NonTensorStack(*[NonTensorData(t) for t in ["a", "b, c", "d", "e,"]]))
    nxt = IFEvalReward(input_mode="text")._step(td.reshape(2, 2), TensorDict(batch_size=[2, 2]))
    assert nxt["reward"].shape == (2, 2, 1, 1)
    assert nxt["success"].view(-1).tolist() == [True, False, True, False]
