import json

import datasets
import pytest

from grpo.data import PositionedLoader, data_position, load_split, skip_to_position
from grpo.envs import load_gsm8k
from grpo.errors import DataError

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


def test_unreadable_file(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"env.dataset=.*cannot read .*train.jsonl .*JSON"):
        load_split(str(tmp_path), "train")


def test_missing_fields(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"q": "x"}])
    with pytest.raises(DataError, match=r"lacks field\(s\) \['question', 'answer'\]"):
        load_split(str(tmp_path), "train", required_fields=("question", "answer"))


def test_gsm8k_rows_need_final_answer_line(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS[:2] + [{"question": "q", "answer": "no final line"}])
    with pytest.raises(DataError, match="row 2.*#### N"):
        load_gsm8k(str(tmp_path), "train")


@pytest.mark.parametrize("row, message", [
    ({"question": None, "answer": "#### 4"}, r"row 2: the question must be non-empty text; got None"),
    ({"question": "  ", "answer": "#### 4"}, r"row 2: the question must be non-empty text"),
    ({"question": "q", "answer": None}, r"row 2: the answer must end with exactly one '#### N' line.*got None"),
])
def test_gsm8k_rows_with_missing_text_are_refused_by_row(tmp_path, row, message):
    """Such rows used to pass the load checks and crash when drawn (or at once, with 'NoneType')."""
    write_jsonl(tmp_path / "d.jsonl", ROWS[:2] + [row] + ROWS[2:])
    with pytest.raises(DataError, match=message):
        load_gsm8k(str(tmp_path / "d.jsonl"), "train")


def test_gsm8k_non_numeric_final_answers_are_flagged(tmp_path):
    write_jsonl(tmp_path / "d.jsonl", ROWS[:3] + [{"question": "q", "answer": "x\n#### four"}])
    with pytest.warns(UserWarning, match=r"1 row\(s\) have a final answer that is not a number \(first: row 3\)"):
        load_gsm8k(str(tmp_path / "d.jsonl"), "train")


def test_text_that_is_not_utf8_is_refused_at_load(tmp_path):
    """It used to load, then raise UnicodeDecodeError when its row was drawn."""
    good = json.dumps(ROWS[0]).encode()
    (tmp_path / "d.jsonl").write_bytes(good + b"\n" + good.replace(b"What", b"Wh\xe9t") + b"\n")
    with pytest.raises(DataError, match=r"Invalid UTF8 sequence.*save the file as UTF-8"):
        load_gsm8k(str(tmp_path / "d.jsonl"), "train")


def test_unknown_hub_dataset_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="could not load split 'train' from the Hugging Face hub"):
        load_split("no-such-org/no-such-dataset", "train")


def test_positioned_loader_counts_batches_across_epochs():
    loader = PositionedLoader(list(range(5)), seed=3, batch_size_dl=2, shuffle=True, collate_fn=list)
    first_epoch, second_epoch = list(loader), list(loader)
    assert len(loader) == 3 and loader.position == 6
    assert sorted(sum(first_epoch, [])) == list(range(5)) and first_epoch != second_epoch
    same_seed = PositionedLoader(list(range(5)), seed=3, batch_size_dl=2, shuffle=True, collate_fn=list)
    assert list(same_seed) == first_epoch


def test_skip_to_position_continues_the_prompt_stream(tiny_data_dir, tiny_model_dir):
    from grpo.envs import GSM8KTaskEnv
    from grpo.models import load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))

    def build():
        return GSM8KTaskEnv(dataset=str(tiny_data_dir), split="train", tokenizer=tokenizer, repeats=2, num_envs=2,
                            seed=0)

    straight = build()
    rows = [straight.reset()["row_index"].tolist() for _ in range(3)]
    resumed = build()
    skip_to_position(resumed, 2)  # as a resume from a checkpoint taken after two resets
    assert resumed.reset()["row_index"].tolist() == rows[2]
    assert data_position(resumed) == data_position(straight) == 3
