"""No finished step is lost, whatever stops the run (issue 64): user code that raises or exits, a disk that
fills mid-run, a run dir deleted under the run, a damaged metrics line, a collapsing policy."""

import errno
import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, compose
from grpo.loop import disk_room
from grpo.loop.best import BestCheckpoint
from grpo.loop.disk_room import HeldRoom
from grpo.loop.logger import RunLogger, plot_metrics, read_metrics
from grpo.loop.resume import truncate_metrics
from grpo.loop.records import RunRecords
from grpo.loop.settings import RecordSettings
from grpo.process.errors import CheckpointError, ConfigError, ResumeError, RunDirError, UserCodeError, clear_errors
from grpo.tasks.settings import TaskSettings
from grpo.tasks.tool_env import make_turn_env
from grpo.tasks.user_rewards import load_reward_function
from grpo.training.checkpoint import list_checkpoints, load_checkpoint
from test_checkpoint import grpo_cmd, step_rows
from test_emergency_checkpoint import script, train  # noqa: F401 - script is a fixture

EXITS_AT_STEP_3 = """import sys

calls = 0


def score(reply):
    global calls
    calls += 1
    if calls > 40:  # the first eval scores 8 replies, steps 1 and 2 score 16 each
        {leave}
    return 1.0
"""


def test_a_reward_that_exits_mid_run_ends_it_in_one_line_keeping_the_finished_steps(script, tmp_path, capsys):  # noqa: F811
    """sys.exit(3) on the reward's 300th call ended the run with status 3, no word, no checkpoint."""
    (tmp_path / "exits.py").write_text(EXITS_AT_STEP_3.format(leave="sys.exit(3)"))
    with pytest.raises(UserCodeError, match=r"^reward.functions\[0\]='.*exits.py:score' on row \d+ called sys.exit\(3\)"):
        train(script, tmp_path / "run", "train.total_steps=4", f"reward.functions=[{tmp_path / 'exits.py'}:score]")
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"step 3 failed (UserCodeError); emergency checkpoint of step 2: {tmp_path}/run/checkpoints/step_00000002.json "
        f"(resume={tmp_path}/run continues from it)")
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step_00000002.json"]


def test_a_reward_that_exits_in_an_async_rollout_worker_ends_the_run_the_same_way(tmp_path):
    """The worker's UserCodeError reaches the trainer whole (pickled by Ray): its frames, its line, the checkpoint."""
    (tmp_path / "exits.py").write_text(EXITS_AT_STEP_3.format(leave="sys.exit(3)").replace("calls > 40", "calls > 32"))
    command = grpo_cmd(tmp_path / "run", "train.total_steps=4", f"reward.functions=[{tmp_path / 'exits.py'}:score]")
    command[1] = str(REPO / "grpo" / "grpo-async.py")
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    *_, note, frame, code, said = proc.stderr.splitlines()
    assert (frame, code) == (f'  File "{tmp_path}/exits.py", line 10, in score', "    sys.exit(3)")
    assert re.fullmatch(rf"error: reward.functions\[0\]='{re.escape(str(tmp_path))}/exits.py:score' on row \d+ called "
                        r"sys.exit\(3\), which would end the run: user code must return, never exit; fix it there "
                        r"\(its frames are above\).", said), said
    finished = max(step_rows(tmp_path / "run"))  # the worker scores ahead of the trainer: step 1 or 2
    assert note.startswith(f"step {finished + 1} failed (UserCodeError); emergency checkpoint of step {finished}: ")
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == [f"step_{finished:08d}.json"]


def test_a_user_code_error_pickles_whole():  # as Ray hands a rollout worker's error to the trainer
    err = pickle.loads(pickle.dumps(UserCodeError("reward.functions[0] raised KeyError", '  File "r.py", line 2\n')))
    assert (str(err), err.frames) == ("reward.functions[0] raised KeyError", '  File "r.py", line 2\n')


@pytest.mark.parametrize("body, said", [
    ("sys.exit(3)", r"called sys.exit\(3\), which would end the run: user code must return, never exit"),
    ("raise KeyboardInterrupt", "raised KeyboardInterrupt"), ("raise GeneratorExit", "raised GeneratorExit"),
    ("raise KeyError('missing')", "raised KeyError: 'missing'")])
def test_whatever_leaves_a_reward_function_is_one_line_below_its_own_frames(tmp_path, capsys, body, said):
    """A raising reward showed 45-55 lines of the project's own frames before the useful last line."""
    (tmp_path / "broken.py").write_text(f"import sys\n\n\ndef score(reply):\n    {body}\n")
    function = load_reward_function(f"{tmp_path / 'broken.py'}:score", 0)
    with pytest.raises(SystemExit) as exited, clear_errors():
        function([{"reply": "a"}], [4], "split 'train'", timeout_s=10)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == (f'  File "{tmp_path}/broken.py", line 5, in score\n    {body}\n'
                   f"error: reward.functions[0]='{tmp_path}/broken.py:score' on row 4 {said.replace(chr(92), '')}; "
                   "fix it there (its frames are above).\n")


def test_a_reward_of_10_to_the_400_is_refused_in_one_line(tmp_path):
    """It raised OverflowError from the project's own check of the return value."""
    (tmp_path / "huge.py").write_text("def score(reply):\n    return 10**400\n")
    function = load_reward_function(f"{tmp_path / 'huge.py'}:score", 0)
    with pytest.raises(ConfigError, match=r"returned 1000000000.*\.\.\. \(int\), past a float's range, for a reply to row 4 .* return a "
                                          r"finite number"):
        function([{"reply": "a"}], [4], "split 'train'", timeout_s=10)


def test_what_leaves_a_users_turn_env_names_the_class_and_method(tmp_path):
    (tmp_path / "env.py").write_text("import sys\n\n\nclass Env:\n    def __init__(self, max_turns, max_episode_tokens):\n"
                                     "        self.max_turns = max_turns\n\n    def answers(self, episode):\n"
                                     "        return True\n\n    def respond(self, episodes):\n        sys.exit(0)\n")
    cfg = compose("grpo_tiny", [f"env.turn_env={tmp_path / 'env.py'}:Env", "env.max_turns=2"])
    env = make_turn_env(TaskSettings.from_config(cfg), tokenizer=None)
    assert env.max_turns == 2 and env.answers(None)
    with pytest.raises(UserCodeError, match=r"^env.turn_env='.*env.py:Env': its respond\(\) called sys.exit\(0\)"):
        env.respond([])


# ------------------------------------------------------------------------------------------- a disk that fills

@pytest.fixture
def small_disk(tmp_path):
    """``small_disk("16k")``: a tmpfs of that size (real ENOSPC), where mounting one is allowed (root)."""
    mounted = []

    def mount(size: str):
        path = tmp_path / f"disk{len(mounted)}"
        path.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode:
            pytest.skip("mounting a tmpfs needs root")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(disk, leave: int) -> None:
    """Take all of ``disk``'s free space but ``leave`` bytes, as another job's files would."""
    with open(disk / "filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, shutil.disk_usage(disk).free - leave)


def test_a_disk_that_fills_mid_run_still_takes_the_checkpoint_due(script, small_disk, monkeypatch, capsys):  # noqa: F811
    """1 MiB left after step 2 failed the checkpoint of step 4 ("this run has no checkpoint"): steps 1-4 lost."""
    disk = small_disk("40m")
    log_step = RunRecords.log_step

    def then_full(self, step, metrics, t0):
        log_step(self, step, metrics, t0)
        if step == 2:
            fill(disk, leave=64 * 2**10)

    monkeypatch.setattr(RunRecords, "log_step", then_full)
    run_dir = disk / "run"
    with pytest.raises(RunDirError, match=rf"^{re.escape(str(run_dir))}'s disk is full \([\d.]+ MiB free\): no room for "
                                          rf"the next checkpoint \(9.5 MiB\); the run stops on its last, {run_dir}/"
                                          r"checkpoints/step_00000004.json. Free [\d.]+ MiB there .*, then "
                                          rf"resume={run_dir} continues from it.$"):
        train(script, run_dir, "train.total_steps=6", "train.checkpoint_frequency=4")
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000004.json"]
    assert not (run_dir / disk_room.ROOM_FILE).exists()  # a run that ended holds no room


@pytest.mark.parametrize("size", ["16k", "4k"])
def test_a_run_dir_without_room_for_its_first_files_is_refused_in_one_line(script, small_disk, size):  # noqa: F811
    """It was an OSError traceback from write_hydra_record."""
    with pytest.raises(RunDirError, match=r"^hydra.run.dir=.* cannot be written \(No space left on device\); free "
                                          r"space on its disk .*, then run again.$"):
        train(script, small_disk(size) / "run", "train.total_steps=1")


def test_the_room_held_is_let_go_for_a_checkpoint_and_taken_back(tmp_path, monkeypatch):
    room = HeldRoom(tmp_path, 2**20)
    assert os.stat(room.path).st_blocks * 512 >= 2**20  # allocated, not a sparse file
    room.release()
    assert not room.path.exists()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_room.os, "posix_fallocate", full)
    assert not room.take() and not room.held and not room.path.exists()
    with pytest.raises(RunDirError, match=r"has no room for this run's next checkpoint \(1.0 MiB\); free space"):
        HeldRoom(tmp_path, 2**20)


# ------------------------------------------------------------------------------- a run dir deleted or moved

@pytest.mark.parametrize("how", ["deleted", "moved"])
def test_a_run_dir_gone_from_its_place_has_its_rows_written_there_again(tmp_path, how):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- train.total_steps=4\n")  # what resume=auto finds it by
    logger = RunLogger(run_dir, RecordSettings.from_config(compose("grpo_tiny", ["logger=none"])), {})
    logger.log({"step": 1, "reward": 0.5})
    logger.log_eval_scores(1, [1.0, 0.0])
    logger.log_eval_replies(1, [{"row": 0, "prompt": "2 + 2?", "reply": "The answer is 4.", "score": 1.0}])
    shutil.rmtree(run_dir) if how == "deleted" else run_dir.rename(tmp_path / "elsewhere")
    with pytest.raises(RunDirError, match=rf"^{re.escape(str(run_dir))} was deleted or moved while the run went on: "
                                          r"its metrics are written there again, with a checkpoint of its last "
                                          rf"finished step, and the run stops; resume={re.escape(str(run_dir))} "
                                          r"continues it.$"):
        logger.log({"step": 2, "reward": 0.25})
    logger.close()
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
    assert (run_dir / "eval_scores.jsonl").read_text() == '{"step": 1, "scores": [1.0, 0.0]}\n'
    assert read_metrics(run_dir / "eval_replies.jsonl") == [
        {"step": 1, "row": 0, "prompt": "2 + 2?", "reply": "The answer is 4.", "score": 1.0}]
    assert (run_dir / ".hydra" / "overrides.yaml").read_text() == "- train.total_steps=4\n"


def test_a_run_dir_deleted_mid_run_stops_it_with_its_state_written_back_and_resume_takes_it(script, tmp_path,  # noqa: F811
                                                                                          monkeypatch):
    """Deleted after step 2 of 4: no word until a 30-line FileNotFoundError at the end, and resume= refused."""
    run_dir = tmp_path / "run"
    log_step = RunRecords.log_step

    def then_deleted(self, step, metrics, t0):
        log_step(self, step, metrics, t0)
        if step == 2:
            shutil.rmtree(run_dir)

    with monkeypatch.context() as patch:
        patch.setattr(RunRecords, "log_step", then_deleted)
        with pytest.raises(RunDirError, match="was deleted or moved while the run went on"):
            train(script, run_dir, "train.total_steps=4")
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000003.json"]
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "reward" in row] == [1, 2, 3]
    train(script, run_dir, "train.total_steps=4", f"resume={run_dir}")
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl") if "reward" in row] == [1, 2, 3, 4]
    # fewer steps than done, constant schedule: it ended "run finished", rc 0, having trained nothing
    with pytest.raises(ResumeError, match=r"step_00000004.json is at step 4, past train.total_steps=3: nothing is "
                                          r"left to train; pass train.total_steps above 4 \(or 0 to evaluate it\).$"):
        train(script, run_dir, "train.total_steps=3", f"resume={run_dir}")


# ------------------------------------------------------------------------------------- a damaged metrics line

def test_a_damaged_metrics_line_is_skipped_naming_the_file_and_line(tmp_path):
    """A damaged middle line stopped resume and the plot with a bare JSONDecodeError naming neither."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "rew\x00\n\n[3]\n{"step": 3}\n{"step": 4, "tor')
    with pytest.warns(UserWarning) as said:
        rows = read_metrics(path)
    assert rows == [{"step": 1}, {"step": 3}]
    assert [str(w.message) for w in said] == [  # the torn last line (a killed run) goes without a word
        f"{path}, line 2: not a JSON row (Invalid control character at: line 1 column 17 (char 16)); skipped",
        f"{path}, line 4: not a JSON row (a list, not an object); skipped"]
    truncate_metrics(path, 3)  # what resume does to it
    assert read_metrics(path) == [{"step": 1}, {"step": 3}]
    plot_metrics(path, tmp_path / "metrics.png")


# ------------------------------------------------------------------------------ the best checkpoint, a collapse

def test_a_collapsing_run_warns_at_each_eval_and_keeps_its_best_weights_apart(script, tmp_path, capsys):  # noqa: F811
    """lr=1.0 with train.on_nonfinite=skip: accuracy fell, rc 0, "run finished", no good checkpoint kept (keep_last
    pruned them), skipped steps never printed."""
    run_dir = tmp_path / "run"
    train(script, run_dir, "optimizer.lr=1.0", "train.on_nonfinite=skip", "train.total_steps=3", "eval.frequency=3",
          "train.checkpoint_frequency=1", "logging.keep_last=1")
    out = capsys.readouterr().out
    best = run_dir / "best" / "step_00000000.json"
    assert "step 1: 3 of 4 optimiser steps skipped (a non-finite gradient, train.on_nonfinite=skip)" in out
    assert (f"step 3: warning: held-out accuracy 0.000 is far below its best, 0.500 at step 0: the policy may have "
            f"collapsed (a lower optimizer.lr?); the best checkpoint is {best}") in out
    assert f"  best           {best} (accuracy 0.500; python -m grpo.export {best} <out> exports it)" in out
    assert "  skipped        3 optimiser steps (non-finite gradients, train.on_nonfinite=skip)" in out
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step_00000003.json"]
    assert load_checkpoint(best)["model"].keys() == load_checkpoint(list_checkpoints(run_dir / "checkpoints")[0])[
        "model"].keys()


def test_an_eval_far_below_the_best_warns_naming_the_best_checkpoint(tmp_path, capsys):
    keep = compose("grpo_tiny", []).logging.keep_best
    best = BestCheckpoint(keep, tmp_path, [{"step": 0, "eval/accuracy": 0.25}, {"step": 10, "eval/accuracy": 0.438}])
    saved = []
    BestCheckpoint(keep, tmp_path, [{"step": 0, "eval/accuracy": 0.15}]).after_eval(10, 0.07, saved.append)
    assert capsys.readouterr().out == "" and saved == []  # under half, but not 10 points below: a small eval's noise
    best.after_eval(30, 0.0, saved.append)
    assert capsys.readouterr().out == ("step 30: warning: held-out accuracy 0.000 is far below its best, 0.438 at step "
                                       "10: the policy may have collapsed (a lower optimizer.lr?)\n")
    best.after_eval(40, 0.5, lambda folder: saved.append(folder) or folder / "step_00000040.json")
    assert saved == [tmp_path / "best"] and best.best == (40, 0.5)
    assert best.summary_line().startswith(f"{tmp_path}/best/step_00000040.json (accuracy 0.500; ")

    def full(folder):
        raise CheckpointError("the checkpoint of step 44: 3.5 MiB needed and best has 1.0 MiB free; ...")

    best.after_eval(44, 0.75, full)  # the best not kept: the run goes on, the summary names the one kept
    assert capsys.readouterr().out == (
        "step 44: warning: its weights (the best held-out accuracy so far) were not kept: the checkpoint of step 44: "
        f"3.5 MiB needed and best has 1.0 MiB free; ... The best kept is {tmp_path}/best/step_00000040.json.\n")
    assert best.summary_line().startswith(f"{tmp_path}/best/step_00000040.json (accuracy 0.500; ")
    for step in (41, 42, 43):  # every optimiser step of 3 steps in a row skipped: nothing is learnt
        best.count_skips({"step": step, "optim_steps": 0, "skipped_optim_steps": 4})
    best.after_eval(43, 0.5, saved.append)
    assert capsys.readouterr().out == (
        "step 43: warning: the last 3 steps skipped every optimiser step (non-finite gradients, train.on_nonfinite="
        f"skip): nothing is learnt; lower optimizer.lr; the best checkpoint is {tmp_path}/best/"
        "step_00000040.json\n")
