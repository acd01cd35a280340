import json

import datasets
import pytest

from grpo.data import DataError, load_split
from grpo.envs import load_gsm8k

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
