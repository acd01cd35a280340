"""benchmarks/learning_curve.py: the training minutes, marks and gains the README's learning curves quote."""

import json
import subprocess
import sys

from conftest import REPO


def write_run(run_dir, step_seconds: float, evals: dict) -> None:
    """A metrics.jsonl of 6 steps of ``step_seconds`` each, with eval rows at the steps ``evals`` names."""
    rows = []
    for step in range(7):
        if step:
            rows.append({"step": step, "reward": 0.5, "step_time_s": step_seconds, "kl_to_ref": 0.01 * step})
        if step in evals:
            rows.append({"step": step, "eval/accuracy": evals[step], "eval/flexible_accuracy": evals[step],
                         "eval/strict_accuracy": evals[step] - 0.01, "eval/response_length": 100.0,
                         **({"eval/gain": evals[step] - evals[0], "eval/gain_stderr": 0.02} if step else {})})
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_curves_put_evals_at_training_minutes_and_report_the_last_eval_before_each_mark(tmp_path):
    """Minutes are the sum of the steps' times (evals excluded): 2-minute steps put step 3's eval at 6 minutes.
    A mark reports the last eval at or before it, with its gain; the JSON keeps the largest KL and the mean step."""
    write_run(tmp_path / "a", 120.0, {0: 0.25, 3: 0.30, 6: 0.35})
    out = tmp_path / "curve"
    printed = subprocess.run([sys.executable, str(REPO / "benchmarks" / "learning_curve.py"), str(tmp_path / "a"),
                              "--labels", "run a", "--marks", "5", "12", "--out", str(out)],
                             capture_output=True, text=True, check=True).stdout
    curve = json.loads(out.with_suffix(".json").read_text())["run a"]
    assert [(e["step"], e["train_minutes"]) for e in curve["evals"]] == [(0, 0.0), (3, 6.0), (6, 12.0)]
    assert curve["at_minutes"]["5.0"]["step"] == 0 and curve["at_minutes"]["12.0"]["step"] == 6
    assert abs(curve["kl_to_ref_max"] - 0.06) < 1e-12 and curve["step_time_s_mean"] == 120.0
    assert out.with_suffix(".png").stat().st_size > 0
    assert printed.strip() == ("run a: step 0 0.250 | 5.0min: 0.250 (step 0) 12.0min: 0.350 (step 6, +10.0 ± 2.0 "
                               "points) | kl_to_ref max 0.060 | step 120.0 s")


def test_curves_take_runs_from_an_earlier_curves_json_whole_or_by_label(tmp_path):
    """A plot can put new run dirs beside an earlier session's runs kept only in its JSON: ``FILE.json:LABEL`` takes
    that run as it was (its marks recomputed), ``FILE.json`` all of them; a label it lacks is a one-line error."""
    write_run(tmp_path / "a", 120.0, {0: 0.25, 3: 0.30, 6: 0.35})
    write_run(tmp_path / "b", 60.0, {0: 0.40, 6: 0.50})
    script, earlier = str(REPO / "benchmarks" / "learning_curve.py"), tmp_path / "earlier"
    subprocess.run([sys.executable, script, str(tmp_path / "a"), str(tmp_path / "b"), "--labels", "run a", "run b",
                    "--out", str(earlier)], capture_output=True, text=True, check=True)
    write_run(tmp_path / "c", 30.0, {0: 0.10, 6: 0.20})
    out = tmp_path / "both"
    subprocess.run([sys.executable, script, str(tmp_path / "c"), f"{earlier}.json:run a", "--labels", "run c",
                    "--marks", "7", "--out", str(out)], capture_output=True, text=True, check=True)
    curves = json.loads(out.with_suffix(".json").read_text())
    assert list(curves) == ["run c", "run a"]
    assert curves["run a"]["evals"] == json.loads(earlier.with_suffix(".json").read_text())["run a"]["evals"]
    assert curves["run a"]["at_minutes"]["7.0"]["step"] == 3 and curves["run c"]["at_minutes"]["7.0"]["step"] == 6
    whole = subprocess.run([sys.executable, script, f"{earlier}.json", "--out", str(tmp_path / "whole")],
                           capture_output=True, text=True, check=True)
    assert list(json.loads((tmp_path / "whole.json").read_text())) == ["run a", "run b"] and "run b:" in whole.stdout
    missing = subprocess.run([sys.executable, script, f"{earlier}.json:run z", "--out", str(tmp_path / "x")],
                             capture_output=True, text=True)
    assert missing.returncode == 1 and missing.stderr.strip().splitlines() == [
        f"learning_curve: {earlier}.json has no run 'run z'; it has ['run a', 'run b']"]
