"""What users look at: one short run of the README's tiny command in a terminal, with TensorBoard, MLflow and CSV at
once and a sampled eval (pass@4); each tool's own reader finds its rows, and the console shows no bar line broken
by other text. Then the pass@k estimator against a hand count, and the tracker adapter on rows of every kind."""

import csv
import itertools
import logging
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, compose_in_run_dir
from grpo.loop.evaluation import pass_at_k
from grpo.loop.logger import RunLogger, read_metrics
from grpo.loop.settings import RecordSettings

SMALL = ["train.total_steps=2", "eval.frequency=1", "eval.num_problems=8", "eval.batch_size=8", "env.num_envs=16",
         "env.repeats=4", "train.dialog_turns_per_batch=16", "train.optim_batch_size=8", "logging.samples_every=1",
         "logging.export=false", "eval.samples_per_problem=4", "logger=[tensorboard,mlflow,csv]"]
BAR = re.compile(r"GRPO: +\d+%\|[^|]*\| \d+/\d+ \[[^\]]*\]")


def console_of(args: list[str]) -> tuple[int, str]:
    """``args`` run with stdout and stderr into one pipe, block-buffered as Python buffers a pipe (a log file, ``| tee``,
    a notebook): what the pipe received, bar and all."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run(args, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=600)
    return proc.returncode, proc.stdout.decode()  # not text=True: it would turn the bar's carriage returns into newlines


def screen_lines(received: str) -> list[str]:
    """The lines a terminal shows of ``received``: a carriage return goes back to the line's start, and what follows
    overwrites (as tqdm redraws its bar)."""
    lines = []
    for raw in received.replace("\r\n", "\n").split("\n"):
        shown = ""
        for part in raw.split("\r"):
            shown = part + shown[len(part):]
        lines.append(shown.rstrip())
    return lines


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The README's tiny command, 2 steps, evals at 0, 1 and 2 with pass@4, replies shown at both steps."""
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    returncode, received = console_of([sys.executable, str(REPO / "grpo" / "grpo.py"), "--config-name", "grpo_tiny",
                                          f"hydra.run.dir={run_dir}", *SMALL])
    assert returncode == 0, received[-4000:]
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [row for row in rows if "reward" in row]
    evals = [row for row in rows if "eval/accuracy" in row]
    assert [row["step"] for row in steps] == [1, 2] and [row["step"] for row in evals] == [0, 1, 2]
    return run_dir, (received, screen_lines(received)), steps, evals


def test_the_console_shows_replies_and_evals_on_their_own_lines_in_the_bar_s_order(tiny_run):
    """Through a pipe, stdout used to reach it only when its buffer filled or the run ended: the replies came after the
    finished bar, and a buffer's flush could land in the middle of a bar line."""
    _, (received, lines), _, _ = tiny_run
    bars = [line for line in lines if "GRPO:" in line]
    assert bars and all(BAR.fullmatch(line) for line in bars), bars  # nothing else in a bar line
    for step in (1, 2):
        shown = lines.index(f"step {step}: replies (all of them in samples.jsonl)")
        assert lines[shown + 1].startswith("  row ") and lines[shown + 2].startswith("     ")
        # in the order they happened: the step's replies, its eval, then the bar counting it done
        assert (received.index(f"step {step}: replies") < received.index(f"step {step}: eval accuracy ")
                < received.index(f"| {step}/2 ["))
    # each long wait says what it waits for; no library's progress bar or warning
    assert any(line.startswith("loading ") for line in lines) and any("evaluating on 8" in line for line in lines)
    assert not [line for line in lines if "warn" in line.lower() or "Loading weights" in line or "split:" in line]
    assert any(line.startswith("  eval pass@4 ") for line in lines)  # the summary


def test_every_eval_row_has_pass_at_4_at_least_avg_at_4(tiny_run):
    _, _, _, evals = tiny_run
    for row in evals:
        assert 0 <= row["eval/avg@4"] <= row["eval/pass@4"] <= 1, row
        assert row["eval/pass@4_stderr"] >= 0 and row["eval/avg@4_stderr"] >= 0


def test_tensorboard_holds_the_step_metrics_the_evals_the_replies_and_the_plot(tiny_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, steps, evals = tiny_run
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    scalars = lambda name: {e.step: e.value for e in events.Scalars(name)}  # noqa: E731
    assert scalars("reward") == pytest.approx({r["step"]: r["reward"] for r in steps})
    assert scalars("eval/accuracy") == pytest.approx({r["step"]: r["eval/accuracy"] for r in evals})
    assert scalars("eval/pass@4") == pytest.approx({r["step"]: r["eval/pass@4"] for r in evals})
    samples = events.Tensors("samples/text_summary")
    assert [s.step for s in samples] == [1, 2] and b"step 2: replies" in samples[1].tensor_proto.string_val[0]
    assert [image.step for image in events.Images("metrics")] == [2]


def test_mlflow_holds_the_step_metrics_the_evals_the_replies_and_the_plot(tiny_run, caplog):
    """And nothing in its store that its readers take for a broken experiment (TorchRL's artifact place was)."""
    from mlflow.tracking import MlflowClient

    run_dir, _, steps, evals = tiny_run
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run_dir / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("grpo-tiny").experiment_id])
    history = lambda name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}  # noqa: E731
    assert history("reward") == pytest.approx({r["step"]: r["reward"] for r in steps})
    assert history("eval/accuracy") == pytest.approx({r["step"]: r["eval/accuracy"] for r in evals})
    assert history("eval/pass_at_4") == pytest.approx({r["step"]: r["eval/pass@4"] for r in evals})
    assert run.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"samples", "metrics.png"} <= artifacts
    text = Path(client.download_artifacts(run.info.run_id, "samples/step_00000001.txt", str(run_dir.parent)))
    assert text.read_text().startswith("step 1: replies")
    assert not [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def test_csv_holds_the_step_metrics_the_evals_and_the_replies(tiny_run):
    run_dir, _, steps, evals = tiny_run

    def column(name):
        with open(run_dir / "csv" / "scalars" / f"{name}.csv", newline="") as file:
            return {int(step): float(value) for step, value in csv.reader(file)}

    assert column("reward") == pytest.approx({r["step"]: r["reward"] for r in steps})
    assert column("eval/accuracy") == pytest.approx({r["step"]: r["eval/accuracy"] for r in evals})
    assert column("eval/avg@4") == pytest.approx({r["step"]: r["eval/avg@4"] for r in evals})
    assert (run_dir / "csv" / "texts" / "samples2.txt").read_text().startswith("step 2: replies")


@pytest.mark.parametrize("n,c,k", [(5, 2, 2), (6, 1, 3), (4, 0, 2), (4, 4, 1), (8, 3, 4), (4, 1, 4)])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n, c, k):
    """By hand: every way to pick k of the n samples (the first c correct), and the share that holds one."""
    subsets = list(itertools.combinations(range(n), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(min(s) < c for s in subsets) / len(subsets))
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)  # avg@n: the unbiased pass@1


def test_the_trackers_take_numbers_replies_and_a_plot_and_skip_the_rest(tmp_path, tiny_model_dir, tiny_data_dir):
    """A start row (text fields), a list field, a pass@k name MLflow cannot spell: numbers only, pass_at_k in MLflow;
    the run's rows in all three, and the plot closed in at the last step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = compose_in_run_dir(tmp_path, [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}",
                                        "logger=[tensorboard,csv,mlflow]"])
    logger = RunLogger(tmp_path, RecordSettings.from_config(cfg), {})
    logger.log({"step": 0, "event": "start", "devices/train": "cpu"})
    logger.log({"step": 3, "reward": 0.5, "prompt_indices": [1, 2], "eval/pass@2": 1.0, "lr": math.nan})
    logger.log_samples(3, [{"group": 0, "row": 7, "prompt": "2 + 2?", "reply": "4", "reward": 1.0}])
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/pass@2", "lr", "reward"]
    assert [image.step for image in events.Images("metrics")] == [3]
    assert sorted(p.name for p in (tmp_path / "csv" / "scalars").rglob("*.csv")) == ["lr.csv", "pass@2.csv", "reward.csv"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient((tmp_path / "mlruns").as_uri())
    [run] = client.search_runs([client.get_experiment_by_name(cfg.logging.experiment_name).experiment_id])
    assert sorted(run.data.metrics) == ["eval/pass_at_2", "lr", "reward"]
