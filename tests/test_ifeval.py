"""Tests for grpo/tasks/ifeval.py and grpo/tasks/ifeval_env.py: strict/loose evaluation, the reward, loading rows through
grpo.tasks.data.load_split, and the TorchRL env and transform. No network, no nltk data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from grpo.process.errors import ConfigError, DataError, clear_errors
from grpo.tasks.ifeval import (DEFAULT_REWARD_WEIGHTS, IFEvalResult, evaluate_response, extract_answer,
                               ifeval_reward, load_ifeval_rows, loose_variants)
from grpo.tasks.ifeval_env import IFEvalReward, make_ifeval_env

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data" / "ifeval_tiny"

LT, AL = "less than", "at least"


def _row(key=1, ids=("punctuation:no_comma",), kwargs=({},)):
    return {"key": key, "prompt": "p", "instruction_id_list": list(ids), "kwargs": list(kwargs)}


def test_empty_response_follows_nothing():
    # forbidden_words would pass on an empty text; IFEval counts empty responses as failing.
    for response in ("", "   \n"):
        result = evaluate_response(
            response, ["keywords:forbidden_words", "punctuation:no_comma"], [{"forbidden_words": ["x"]}, {}]
        )
        assert result.strict == [False, False]
        assert result.loose == [False, False]


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


# ---- per-response accuracies on a fixed set computed by hand ---------------------------

EVAL_SET = [
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


def test_evaluate_response_by_hand():
    for ids, kwargs, response, strict, loose in EVAL_SET:
        result = evaluate_response(response, ids, kwargs)
        assert (result.strict, result.loose) == (strict, loose)
    ids, kwargs, response, _, _ = EVAL_SET[1]
    assert evaluate_response(response, ids, kwargs).accuracies() == {
        "prompt_level_strict_acc": 0.0,
        "inst_level_strict_acc": 0.5,
        "prompt_level_loose_acc": 1.0,
        "inst_level_loose_acc": 1.0,
    }


def test_evaluate_response_needs_instructions():
    assert isinstance(evaluate_response("x", ["punctuation:no_comma"]), IFEvalResult)
    with pytest.raises(DataError):
        evaluate_response("x", [])
    with pytest.raises(DataError, match="2 instruction ids but 1 kwargs"):
        evaluate_response("x", ["punctuation:no_comma"] * 2, [{}])


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
    with pytest.raises(ConfigError, match="prompt_strcit"):
        ifeval_reward("x", ["punctuation:no_comma"], [{}], {"prompt_strcit": 1.0})


def test_extract_answer():
    assert extract_answer("<think>t</think><answer>\n hi \n</answer>") == "hi"
    assert extract_answer("<answer>unclosed") is None


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
    with pytest.raises(DataError, match=r"without train\.jsonl"):
        load_ifeval_rows(tmp_path, "train")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_row(1)) + "\n" + json.dumps(_row(5, ["nope:nope"], [{}])) + "\n")
    with pytest.raises(DataError, match=r"env.dataset='.*bad.jsonl' split 'train' row 1 \(key=5\), "
                                        r"instruction 0 'nope:nope': unsupported instruction id"):
        load_ifeval_rows(bad)
    (tmp_path / "broken.jsonl").write_text(json.dumps(_row(1)) + "\n{not json\n")
    with pytest.raises(DataError, match=r"cannot read .*broken.jsonl .*JSON"):
        load_ifeval_rows(tmp_path / "broken.jsonl")
    (tmp_path / "nokwargs.jsonl").write_text(json.dumps({"key": 1, "prompt": "p", "instruction_id_list": []}) + "\n")
    with pytest.raises(DataError, match=r"lacks field\(s\) \['kwargs'\]"):
        load_ifeval_rows(tmp_path / "nokwargs.jsonl")


def test_bad_row_is_one_line_error(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text(json.dumps(_row(3, ["x:y"], [{}])) + "\n")
    with pytest.raises(SystemExit) as info, clear_errors():
        load_ifeval_rows(tmp_path, "train")
    assert info.value.code == 2
    err = capsys.readouterr().err  # datasets' progress bar may come first
    last = err.rstrip("\n").split("\n")[-1]
    assert last.startswith("error: env.dataset=") and "row 0 (key=3), instruction 0 'x:y'" in last
    assert "Traceback" not in err


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



def test_hub_name_offline_is_a_data_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="could not load split 'train' from the Hugging Face hub"):
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


def test_the_checker_sees_the_reply_a_user_reward_sees_every_trailing_special_token_cut(tokenizer):
    """It cut one eos and one <|im_end|>: a reply ending in <|im_end|> and a pad failed the format check, while
    a user reward function in the same run read it without them."""
    from torchrl.envs.llm import IFEvalEnv

    from grpo.tasks.rewards import special_tokens, strip_trailing_special_tokens

    env = IFEvalEnv(dataset=str(DATA), shuffle=False, seed=0, num_envs=2, tokenizer=tokenizer, compute_reward=False)
    env.append_transform(IFEvalReward(tokenizer=tokenizer))
    answer = "<think>easy</think><answer>cats sleep all day long and purr softly.</answer>"
    replies = [answer + tokenizer.eos_token * 2, answer + "<|im_end|>" + tokenizer.pad_token + " \n"]
    assert {strip_trailing_special_tokens(r, special_tokens(tokenizer)) for r in replies} == {answer}
    _, nxt = _step_with(env, replies)
    assert _values(nxt, "format_ok") == [1.0, 1.0]
    assert _values(nxt, "prompt_level_loose_acc") == [1.0, 1.0]


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
    with pytest.raises(DataError, match="punctuation:no_coma"):
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

