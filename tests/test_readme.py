"""Every training command in the README names a script that exists, a config that composes with its
overrides, and passes the config checks: a renamed key, config or script breaks this test, not a user's
first GPU run. (The CPU ones also run end to end: test_e2e, test_user_task.)"""

import re
import shlex
from pathlib import Path

import pytest

from conftest import compose
from grpo.loop.config import validate_config
from grpo.process.errors import ModelLoadError

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[list[str]]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [shlex.split(line, comments=True) for line in lines if re.match(r"python3? grpo/", line)]


COMMANDS = readme_commands()


def test_the_readme_shows_every_script_and_task_config():
    shown = {(args[1], args[args.index("--config-name") + 1] if "--config-name" in args else "grpo_gsm8k")
             for args in COMMANDS}
    assert {script for script, _ in shown} == {"grpo/grpo.py", "grpo/grpo-async.py"}
    assert {"grpo_gsm8k", "grpo_tiny", "grpo_ifeval", "grpo_qwen05b"} <= {config for _, config in shown}


@pytest.mark.parametrize("args", COMMANDS, ids=[" ".join(a[1:4]) for a in COMMANDS])
def test_a_readme_command_composes_and_passes_the_config_checks(args):
    assert (REPO / args[1]).is_file()
    rest = args[2:]
    config = "grpo_gsm8k"
    if "--config-name" in rest:
        i = rest.index("--config-name")
        config, rest = rest[i + 1], rest[:i] + rest[i + 2:]
    # a sweep's first point stands for the sweep
    overrides = [arg.split(",")[0] if "=" in arg and "[" not in arg else arg for arg in rest if arg != "--multirun"]
    if "model.name=/models/qwen2.5-7b" in overrides:  # the README's example of local paths: on this machine, none
        with pytest.raises(ModelLoadError, match=r"^model.name='/models/qwen2.5-7b': no such folder\."):
            validate_config(compose(config, overrides))
        return
    validate_config(compose(config, overrides))
