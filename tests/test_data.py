import json
from types import SimpleNamespace

import datasets
import pytest

from grpo.process.errors import DataError, ResumeError
from grpo.tasks.data import PromptLedger, PromptStream, data_primer, load_split, serve_from
from grpo.tasks.envs import load_gsm8k

ROWS = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(6)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_folder_of_split_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS[:4])
    write_jsonl(tmp_path / "test.jsonl", ROWS[4:])
    assert len(load_split(str(tmp_path), "train")) == 4
    assert load_split(str(tmp_path), "test")["question"] == [r["question"] for r in ROWS[4:]]


def test_single_file_and_parquet(tmp_path):
    write_jsonl(tmp_path / "all.jsonl", ROWS)
    assert len(load_split(str(tmp_path / "all.jsonl"), "train")) == 6
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "all.parquet"))
    assert load_split(str(tmp_path / "all.parquet"), "test")["answer"][0] == ROWS[0]["answer"]


def test_save_to_disk_folder(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:5]),
                          "test": datasets.Dataset.from_list(ROWS[5:])}).save_to_disk(str(tmp_path / "dd"))
    assert len(load_split(str(tmp_path / "dd"), "train")) == 5
    with pytest.raises(DataError, match="splits"):
        load_split(str(tmp_path / "dd"), "validation")


def test_missing_path_names_key_and_fix(tmp_path):
    with pytest.raises(DataError, match=r"env.dataset=.*no such file or folder.*hub name"):
        load_split(str(tmp_path / "nope"), "train")


def test_missing_fields(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"q": "x"}])
    with pytest.raises(DataError, match=r"lacks field\(s\) \['question', 'answer'\]"):
        load_split(str(tmp_path), "train", required_fields=("question", "answer"))


def test_gsm8k_rows_need_final_answer_line(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS[:2] + [{"question": "q", "answer": "no final line"}])
    with pytest.raises(DataError, match="row 2.*#### N"):
        load_gsm8k(str(tmp_path), "train")


def test_unknown_hub_dataset_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="could not load split 'train' from the Hugging Face hub"):
        load_split("no-such-org/no-such-dataset", "train")


def test_prompt_batch_k_is_a_function_of_seed_and_k():
    stream = PromptStream(5, seed=3)
    epochs = [[stream.row(p) for p in range(e * 5, e * 5 + 5)] for e in range(3)]
    assert all(sorted(e) == list(range(5)) for e in epochs) and epochs[0] != epochs[1]  # a new order each epoch
    assert stream.batch(2, 2) == [epochs[0][4], epochs[1][0]]  # a batch may straddle two epochs
    fresh = PromptStream(5, seed=3)
    assert fresh.batch(7, 2) == PromptStream(5, seed=3).batch(7, 2) and fresh.batch(0, 2) == stream.batch(0, 2)
    assert PromptStream(5, seed=4).batch(0, 5) != stream.batch(0, 5)
    assert PromptStream(5, seed=3, shuffle=False).batch(1, 3) == [3, 4, 0]  # file order, wrapping
    assert PromptStream(1, seed=0).batch(3, 4) == [0, 0, 0, 0]


def test_serve_from_points_the_env_at_any_batch(tiny_data_dir, tiny_model_dir):
    """Building the env and its collector draws prompts; serve_from drops them (step 1 trains batch 0)."""
    from grpo.tasks.envs import GSM8KTaskEnv
    from grpo.training.models import load_tokenizer

    env = GSM8KTaskEnv(dataset=str(tiny_data_dir), split="train", tokenizer=load_tokenizer(str(tiny_model_dir)),
                       repeats=2, num_envs=6, seed=0)
    stream = data_primer(env).dataloader.stream
    env.reset()  # as the collector's first reset does
    collector = SimpleNamespace(_shuttle="the batch drawn after the last step")
    for index in (0, 5, 2):
        serve_from(env, collector, index)
        assert collector._shuttle is None  # the collector resets the env before its next batch
        rows = env.reset()["row_index"].tolist()
        assert rows == [row for row in stream.batch(index, 3) for _ in range(2)]  # each prompt once per reply
        assert env.reset()["row_index"].tolist()[::2] == stream.batch(index + 1, 3)  # then the stream goes on


def test_prompt_ledger_state_is_what_was_consumed_and_json():
    ledger = PromptLedger()
    assert [ledger.take() for _ in range(5)] == [0, 1, 2, 3, 4]
    ledger.consume([0, 1, 3])  # trained (or dropped as stale)
    ledger.release([4])  # lost with a worker
    state = json.loads(json.dumps(ledger.state()))
    assert state == {"next_batch": 5, "pending": [2, 4]}
    resumed = PromptLedger(state)
    assert [resumed.take() for _ in range(3)] == [2, 4, 5]  # what was in flight first, then new batches
    assert PromptLedger({"next_batch": 6, "pending": [4, 5]}).sequential_start() == 4
    with pytest.raises(ResumeError, match="out of order.*resume it with grpo-async.py"):
        PromptLedger(state).sequential_start()
    with pytest.raises(ResumeError, match="no prompt-stream state"):
        PromptLedger.from_checkpoint({"step": 3})
