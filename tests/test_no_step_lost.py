"""No finished step is lost, whatever stops the run (issue 64): user code that raises or exits, a disk that
fills mid-run, a run dir deleted under the run, a damaged metrics line, a collapsing policy."""

import pytest

from conftest import compose
from grpo.process.errors import ConfigError, UserCodeError, clear_errors
from grpo.tasks.tool_env import make_turn_env
from grpo.tasks.user_rewards import load_reward_function
from grpo.training.checkpoint import list_checkpoints
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
    with pytest.raises(ConfigError, match=r"returned 1000000000.*\.\.\. \(int\) for a reply to row 4 .* return a "
                                          r"finite number"):
        function([{"reply": "a"}], [4], "split 'train'", timeout_s=10)


def test_what_leaves_a_users_turn_env_names_the_class_and_method(tmp_path):
    (tmp_path / "env.py").write_text("import sys\n\n\nclass Env:\n    def __init__(self, max_turns, max_episode_tokens):\n"
                                     "        self.max_turns = max_turns\n\n    def answers(self, episode):\n"
                                     "        return True\n\n    def respond(self, episodes):\n        sys.exit(0)\n")
    cfg = compose("grpo_tiny", [f"env.turn_env={tmp_path / 'env.py'}:Env", "env.max_turns=2"])
    env = make_turn_env(cfg, tokenizer=None)
    assert env.max_turns == 2 and env.answers(None)
    with pytest.raises(UserCodeError, match=r"^env.turn_env='.*env.py:Env': its respond\(\) called sys.exit\(0\)"):
        env.respond([])
