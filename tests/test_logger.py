"""grpo/logger.py: the metrics file survives as rows are written; the profiler writes its files."""

import gzip
import json

import torch

from grpo.logger import profile_to, read_metrics


def test_profile_to_writes_an_op_table_and_a_trace(tmp_path):
    with profile_to(tmp_path, step=3):
        a = torch.randn(64, 64)
        (a @ a).sum()
    table = (tmp_path / "profile_step3.txt").read_text()
    assert "aten::mm" in table
    with gzip.open(tmp_path / "profile_step3.json.gz", "rt") as f:
        trace = json.load(f)
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    assert not (tmp_path / "profile_step3.json").exists()


def test_read_metrics_reads_every_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n\n" + json.dumps({"step": 2, "reward": 0.7}) + "\n")
    assert [r["reward"] for r in read_metrics(path)] == [0.5, 0.7]
