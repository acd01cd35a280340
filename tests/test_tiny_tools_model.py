"""Tests for the shipped tiny tool-use model (assets/tiny-tools-model), its tokenizer and data."""

import json
import random
import re
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from grpo.tasks.python_tool import PYTHON_TOOL
from tools import synthetic_tools as st
from tools import tiny_tools as tt
from tools.tiny_model import model_fixtures

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "assets" / "tiny-tools-model"
DATA_DIR = REPO / "data" / "tools_tiny"

TOOLS_BLOCK = (
    "\n\n# Tools\n<tools>\n"
    + json.dumps(PYTHON_TOOL)
    + '\n</tools>\nCall a tool as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
)


tok, model = model_fixtures(MODEL_DIR)


@pytest.fixture(scope="module")
def test_split():
    return st.read_jsonl(DATA_DIR / "test.jsonl")


def test_tags_are_single_non_special_tokens(tok):
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert "<|im_start|>" in tok.all_special_tokens
    ids = set()
    for t in tt.TAG_TOKENS:
        t_ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(t_ids) == 1, t
        assert t not in tok.all_special_tokens, t
        assert tok.convert_tokens_to_ids(t) == t_ids[0]
        ids.add(t_ids[0])
    assert len(ids) == 6
    # not special: they survive skip_special_tokens; glued to text they stay one token
    text = '<tool_call>{"name": "python"}</tool_call><|im_end|>'
    out = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(out, skip_special_tokens=True) == '<tool_call>{"name": "python"}</tool_call>'
    assert out[0] == tok.convert_tokens_to_ids("<tool_call>") and out[-2] == tok.convert_tokens_to_ids("</tool_call>")


def test_digits_are_one_token_each(tok):
    ids = tok("print(48213 * 917)", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert [p for p in pieces if any(c.isdigit() for c in p)] == list("48213917")


def test_template_renders_tools_block(tok):
    msgs = [{"role": "system", "content": tt.SYSTEM_PROMPT}, {"role": "user", "content": "What is 2 * 3?"}]
    text = tok.apply_chat_template(msgs, tools=[PYTHON_TOOL], add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\n" + tt.SYSTEM_PROMPT + TOOLS_BLOCK
        + "<|im_start|>user\nWhat is 2 * 3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == tt.build_prompt(tok, "What is 2 * 3?")
    # no system message: the system turn holds the tools block only
    text = tok.apply_chat_template(msgs[1:], tools=[PYTHON_TOOL], tokenize=False)
    assert text == "<|im_start|>system\n" + TOOLS_BLOCK + "<|im_start|>user\nWhat is 2 * 3?<|im_end|>\n"
    # no tools: plain ChatML
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>system\n" + tt.SYSTEM_PROMPT + "<|im_end|>\n<|im_start|>user\nWhat is 2 * 3?<|im_end|>\n"
    )


def test_template_renders_tool_message(tok):
    call = '<tool_call>{"name": "python", "arguments": {"code": "print(48213 * 917)"}}</tool_call>'
    msgs = [
        {"role": "system", "content": tt.SYSTEM_PROMPT},
        {"role": "user", "content": "What is 48213 * 917?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "44211321\n"},
        {"role": "assistant", "content": "<answer>44211321</answer>"},
    ]
    text = tok.apply_chat_template(msgs, tools=[PYTHON_TOOL], tokenize=False)
    assert text == (
        "<|im_start|>system\n" + tt.SYSTEM_PROMPT + TOOLS_BLOCK
        + "<|im_start|>user\nWhat is 48213 * 917?<|im_end|>\n"
        + "<|im_start|>assistant\n" + call + "<|im_end|>\n"
        + "<|im_start|>user\n<tool_response>\n44211321\n\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n<answer>44211321</answer><|im_end|>\n"
    )
    assert tt.tool_turn_text(tok, "44211321\n") == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n44211321\n\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    # the generation markers: the assistant mask covers both assistant contents, nothing else
    out = tok.apply_chat_template(msgs, tools=[PYTHON_TOOL], tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    ids = torch.tensor(out["input_ids"])
    mask = torch.tensor(out["assistant_masks"]).bool()
    assert tok.decode(ids[mask]) == call + "<answer>44211321</answer>"


def test_episode_tokenizes_the_same_piecewise_and_whole(tok, test_split):
    """Turn 1, the tool turn and turn 2 tokenized apart equal the whole episode tokenized at once:
    every boundary is an added token (</tool_call>, <|im_end|>, <answer>), so no BPE merge crosses it."""
    rng = random.Random(0)
    for i, p in enumerate(test_split[:40]):
        pieces = tt.episode_pieces(tok, p, "tool" if i % 2 == 0 else "direct", rng)
        ids, mask = tt.encode_pieces(tok, pieces)
        assert ids == tok("".join(t for t, _ in pieces), add_special_tokens=False)["input_ids"]
        assert len(ids) <= 300
        trained = tok.decode([t for t, m in zip(ids, mask) if m])
        assert trained == "".join(t for t, m in pieces if m)
    # the whole conversation rendered by the template is the same text as the pieces
    p = test_split[0]
    pieces = tt.episode_pieces(tok, p, "tool")
    result = st.parse_answer(p["answer"])["result"]
    msgs = tt.messages(p["question"]) + [
        {"role": "assistant", "content": tt.tool_call_text(p)},
        {"role": "tool", "content": f"{result}\n"},
        {"role": "assistant", "content": f"<answer>{result}</answer>"},
    ]
    rendered = tok.apply_chat_template(msgs, tools=[PYTHON_TOOL], tokenize=False)
    assert rendered == "".join(t for t, _ in pieces) + "\n"


@pytest.mark.parametrize("split, n", [("train", 2000), ("test", 256)])
def test_data_files(split, n):
    rows = st.read_jsonl(DATA_DIR / f"{split}.jsonl")
    assert len(rows) == n
    for r in rows:
        assert set(r) == {"question", "answer"}
        info = st.parse_answer(r["answer"])
        a, op, b = info["a"], info["op"], info["b"]
        assert info["result"] == {"+": a + b, "-": a - b, "*": a * b}[op] >= 0
        assert r["answer"].endswith(f"\n#### {info['result']}")
        assert r["question"].index(str(a)) < r["question"].rindex(str(b))
        if op == "*":
            assert 1000 <= a <= 99999 and 100 <= b <= 9999
        else:
            assert 100_000 <= min(a, b) and max(a, b) <= 9_999_999
    # the files are what the builder's seed gives (write_splits: test first)
    seed = json.loads((MODEL_DIR / "build_info.json").read_text())["seed"]
    problems = st.make_problems(2256, seed)
    assert rows == (problems[:256] if split == "test" else problems[256:])


def test_splits_are_disjoint():
    train = {st.expression(r) for r in st.read_jsonl(DATA_DIR / "train.jsonl")}
    test = {st.expression(r) for r in st.read_jsonl(DATA_DIR / "test.jsonl")}
    assert not train & test


def test_model_config(model, tok):
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.head_dim == 32 and cfg.hidden_size == 128 and cfg.num_hidden_layers == 3
    assert cfg.max_position_embeddings == 512
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 4
    assert cfg.rope_parameters["rope_theta"] == 1000.0
    assert cfg.tie_word_embeddings and model.dtype == torch.float32
    assert cfg.vocab_size == len(tok)
    assert model.generation_config.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert 0 < tt.model_file_size(MODEL_DIR) <= 10 * 1024 * 1024


def test_sampled_turn1_calls_the_tool_sometimes(model, tok, test_split):
    """64 turns 1 at temperature 1: some are well-formed tool calls, some direct answers."""
    problems = test_split[:64]
    close_id = tok.convert_tokens_to_ids("</tool_call>")
    enc = tok([tt.build_prompt(tok, p["question"]) for p in problems], return_tensors="pt", padding=True,
              add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=48, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             eos_token_id=[close_id, tok.eos_token_id], pad_token_id=tok.pad_token_id)
    calls = direct = 0
    for p, row in zip(problems, out[:, enc["input_ids"].shape[1]:].tolist()):
        text = tok.decode([t for t in row if t != tok.pad_token_id])
        if tt.tool_call_expression(text) == st.expression(p) and text.endswith("</tool_call>"):
            calls += 1
        elif re.fullmatch(r"<answer>\d+</answer><\|im_end\|>", text):
            direct += 1
    assert calls >= 4, (calls, direct)
    assert direct >= 16, (calls, direct)
