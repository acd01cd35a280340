"""Tests for the embedded tiny model (assets/tiny-model) and its tokenizer."""

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from tools import tiny_model as tm  # noqa: E402
from tools.synthetic import make_problems  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "assets" / "tiny-model"


tok, model = tm.model_fixtures(MODEL_DIR)


def test_tokenizer_special_and_tag_tokens(tok):
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert 300 <= len(tok) <= 600
    assert tok.eos_token == "<|im_end|>"
    assert tok.pad_token == "<|endoftext|>"
    assert tok.pad_token_id != tok.eos_token_id
    assert "<|im_start|>" in tok.all_special_tokens
    for t in tm.TAG_TOKENS:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, t
        assert t not in tok.all_special_tokens
    for t in tm.SPECIAL_TOKENS:
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1, t


def test_tokenizer_round_trip(tok):
    text = "<think>19 + 6 = 25</think><answer>25</answer><|im_end|>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    # tags are not special: they survive skip_special_tokens
    assert tok.decode(ids, skip_special_tokens=True) == "<think>19 + 6 = 25</think><answer>25</answer>"
    for p in make_problems(20, seed=11):
        for s in (p["question"], p["answer"], tm.format_response(p), tm.format_response(p, "plain")):
            assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s
    # text outside the training corpus still round-trips (byte-level)
    odd = "Zoë paid $12,345.67 — 100% ✓\n\ttabs"
    assert tok.decode(tok(odd, add_special_tokens=False)["input_ids"]) == odd


def test_built_tokenizer_survives_autotokenizer(tok, tmp_path):
    """A freshly built tokenizer tokenizes the same after save + AutoTokenizer.

    AutoTokenizer (which vLLM and TorchRL use) loads a qwen2 model directory
    with Qwen2Tokenizer, so build_tokenizer must train with its pipeline.
    """
    built = tm.build_tokenizer(make_problems(300, seed=1))
    built.save_pretrained(tmp_path)
    transformers.Qwen2Config(vocab_size=len(built)).save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for p in make_problems(10, seed=2):
        text = tm.build_prompt(built, p["question"]) + tm.format_response(p) + "<|im_end|>"
        assert loaded(text)["input_ids"] == built(text)["input_ids"]
    assert loaded.chat_template == built.chat_template
    # the shipped tokenizer uses the same pipeline
    saved = json.loads((MODEL_DIR / "tokenizer.json").read_text())
    fresh = json.loads(built.backend_tokenizer.to_str())
    for key in ("normalizer", "pre_tokenizer", "decoder"):
        assert saved[key] == fresh[key], key


def test_prompt_matches_torchrl_history(tok):
    pytest.importorskip("torchrl")
    for p in make_problems(5, seed=5):
        history = tm.make_history(p["question"])
        via_torchrl = history.apply_chat_template(tokenizer=tok, add_generation_prompt=True)
        msgs = [
            {"role": "system", "content": tm.system_prompt()},
            {"role": "user", "content": p["question"]},
        ]
        via_hf = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert via_torchrl == via_hf == tm.build_prompt(tok, p["question"])
        # TorchRL's own fallback templates render the same text
        for name in ("chatml_format", "qwen"):
            assert history.apply_chat_template(tokenizer=tok, chat_template_name=name, add_generation_prompt=True) == via_hf
        assert via_hf.startswith("<|im_start|>system\n" + tm.system_prompt() + "<|im_end|>\n<|im_start|>user\n")
        assert via_hf.endswith(p["question"] + "<|im_end|>\n<|im_start|>assistant\n")


def test_torchrl_assistant_mask(tok):
    pytest.importorskip("torchrl")
    import tensordict
    from torchrl.data.llm import History

    tensordict.set_list_to_stack(True).set()
    content = "<think>1 + 1 = 2</think><answer>2</answer>"
    history = History(
        role=["system", "user", "assistant"], content=[tm.system_prompt(), "Q?", content], batch_size=(3,)
    )
    out = history.apply_chat_template(tokenizer=tok, add_generation_prompt=False, return_assistant_tokens_mask=True)
    mask = out["assistant_masks"].bool()
    assert tok.decode(out["input_ids"][mask]) == content


def test_chat_template_assistant_turn(tok):
    msgs = [
        {"role": "user", "content": "Q?"},
        {"role": "assistant", "content": "<think>1 + 1 = 2</think><answer>2</answer>"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n<think>1 + 1 = 2</think><answer>2</answer><|im_end|>\n"
    )


def test_model_config_and_size(model, tok):
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.head_dim >= 32
    assert cfg.hidden_size == cfg.num_attention_heads * cfg.head_dim
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.tie_word_embeddings
    assert cfg.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert model.dtype == torch.float32
    assert 0 < tm.model_file_size(MODEL_DIR) <= 10 * 1024 * 1024
    assert "qwen" not in str(MODEL_DIR).lower()


def test_model_generates_a_response(model, tok):
    problems = make_problems(4, seed=0)
    prompt = tm.build_prompt(tok, problems[0]["question"])
    enc = tok([prompt], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=32, do_sample=False)
    text = tok.decode(out[0, enc["input_ids"].shape[1]:])
    assert text.startswith("<think>")
    assert text.endswith("<|im_end|>")


def test_evaluate_greedy_small(model, tok):
    problems = make_problems(8, seed=0)
    res = tm.evaluate_greedy(model, tok, problems, 32)
    assert res["n"] == 8
    for k in ("accuracy", "format_rate", "number_accuracy"):
        assert 0.0 <= res[k] <= 1.0


def test_score_response():
    gold = "3 + 5 = 8\n#### 8"
    assert tm.score_response("<think>3 + 5 = 8</think><answer>8</answer><|im_end|>", gold) == {
        "correct": True,
        "format": True,
        "number_correct": True,
    }
    assert tm.score_response("<think>3 + 5 = 8</think>The answer is 8.", gold) == {
        "correct": False,
        "format": False,
        "number_correct": True,
    }
    assert tm.score_response("<think>3 + 5 = 9</think><answer>9</answer>", gold)["correct"] is False
