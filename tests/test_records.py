"""grpo/loop/records.py: what each step's metrics row says about the step beyond the trainer's numbers."""

import torch

from conftest import compose
from grpo.loop.logger import RunLogger, read_metrics
from grpo.loop.records import RunRecords
from grpo.loop.settings import RecordSettings


def test_a_step_row_counts_the_graphs_torch_compile_made_in_it(tmp_path):
    """A step that compiled (a first shape, then a batch of one row: dynamo specialises on size 1) counts
    its graphs; a step that only reuses them counts none, nor does one after a compile between steps (an eval's)."""
    settings = RecordSettings.from_config(compose("grpo_tiny"))
    records = RunRecords(settings, tmp_path, {}, RunLogger(tmp_path, settings, {}), None, [])
    double = torch.compile(lambda x: 2 * x, dynamic=True)
    for step, rows in enumerate([3, 4, 1, 5], start=1):
        t0 = records.start_step()
        double(torch.ones(rows))
        records.log_step(step, {"reward": 0.0}, t0)
        if step == 3:
            double(torch.ones(2, 2))  # between steps: a new rank compiles
    records.logger.close(0)
    assert [row["graphs_compiled"] for row in read_metrics(tmp_path / "metrics.jsonl")] == [1, 0, 1, 0]
