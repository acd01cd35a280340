"""grpo/tasks/tool_env.py and python_tool.py: tool calls parsed from a turn, run in the real sandbox, every
malformed call answered with what was wrong (never an exception), and the config's turn settings checked."""

import pytest

from conftest import compose
from grpo.process.errors import ConfigError
from grpo.tasks.python_tool import EXAMPLE_CALL, holds_call, output_block, parse_call
from grpo.tasks.sandbox import Sandbox, SandboxSettings
from grpo.tasks.settings import TaskSettings, check_turn_config
from grpo.tasks.tool_env import Episode, PythonCodeBlockEnv, PythonToolEnv, UserTurnEnv, env_tools, turn_stop_ids
from grpo.tasks.user_code import UserCodeError


def call(code: str) -> str:
    return '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>' % __import__("json").dumps(code)


def episode(*turns: str) -> Episode:
    """An episode whose assistant turns are ``turns``, the tool having answered each but the last."""
    messages = []
    for text in turns[:-1]:
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": "ok"}]
    return Episode(prompt=[{"role": "user", "content": "q"}], messages=[*messages, {"role": "assistant",
                                                                                   "content": turns[-1]}], row_index=0)


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}</tool_call>', "not valid JSON"),
    ('<tool_call>{"name": "shell", "arguments": {"cmd": "ls"}}</tool_call>', "unknown tool 'shell'"),
    ('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}', "no closing </tool_call>"),
    ('<tool_call>{"name": "python", "arguments": {"source": "print(1)"}}</tool_call>', 'one argument, "code"'),
    ('<tool_call>[1, 2]</tool_call>', "a JSON object"),
])
def test_a_malformed_call_is_named_and_answered_with_the_call_to_write(text, error):
    code, message = parse_call(text)
    assert code is None and error in message and EXAMPLE_CALL in message


def test_a_call_s_code_is_read_whether_its_arguments_are_an_object_or_a_json_string():
    assert parse_call("I will compute. " + call("print(6 * 7)")) == ("print(6 * 7)", None)
    # Qwen2.5-Coder-0.5B's own habit: the call as a fenced JSON object
    fenced = '```json\n{"name": "python", "arguments": {"code": "print(18 + 10)"}}\n```'
    assert holds_call(fenced) and parse_call(fenced) == ("print(18 + 10)", None)
    assert not holds_call('```python\nprint(1)\n```') and not holds_call("The answer is 4.")
    assert parse_call('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>') == (
        "print(1)", None)


@pytest.fixture(scope="module")
def tool_env():
    return PythonToolEnv(Sandbox(SandboxSettings(timeout_s=2.0, cpu_s=2, workers=4)), max_turns=4,
                         max_episode_tokens=400, max_calls=2)


def test_the_tool_answers_a_batch_at_once_and_every_bad_call_gets_a_message_not_an_exception(tool_env):
    episodes = [episode(call("print(2 ** 100)")),
                episode("<tool_call>{oops}</tool_call>"),
                episode(call("while True: pass")),                      # held to its timeout, alone
                episode(call("print(1)"), call("print(2)"), call("print(3)")),  # a third call past max_calls=2
                episode(call("raise ValueError('bad input')")),
                episode(call("x = 1"))]
    assert all(tool_env.answers(e) for e in episodes) and not tool_env.answers(episode("The answer is 4."))
    turns = tool_env.respond(episodes)
    assert [t.message["role"] for t in turns] == ["tool"] * 6
    assert turns[0].message["content"].strip() == str(2 ** 100) and turns[0].counts == {
        "tool_calls": 1, "tool_timeouts": 0, "tool_errors": 0}
    assert "not valid JSON" in turns[1].message["content"] and turns[1].counts["tool_errors"] == 1
    assert turns[2].counts["tool_timeouts"] == 1 and "timed out" in turns[2].message["content"]
    assert "no more tool calls" in turns[3].message["content"]
    assert "ValueError: bad input" in turns[4].message["content"] and turns[4].counts["tool_errors"] == 1
    assert "no output" in turns[5].message["content"]


@pytest.mark.parametrize("overrides, error", [
    (["env.max_turns=3"], "needs something to answer between turns"),
    (["env.tools=[python]"], "env.max_turns=1 leaves no turn"),
    (["env.tools=[shell]", "env.max_turns=2"], "the tools are [python]"),
    (["env.tools=[python]", "env.max_turns=2", "env.turn_env=x.py:Env"], "one answers between turns"),
    (["env.max_turns=0"], "at least one assistant turn"),
    (["env.max_episode_tokens=-5"], "a positive number of tokens"),
    (["env.tools=[python]", "env.max_turns=2", "tools.call_format=json"], "tools.call_format='json': write tool_call"),
])
def test_turn_settings_that_cannot_work_are_refused_in_one_line(overrides, error):
    with pytest.raises(ConfigError, match=__import__("re").escape(error)):
        check_turn_config(TaskSettings.from_config(compose("grpo_tiny", overrides)))


def test_the_code_interpreter_runs_a_turn_s_first_python_block_and_answers_inline_in_the_reply(tool_env):
    blocks = PythonCodeBlockEnv(tool_env.sandbox, max_turns=4, max_episode_tokens=400, max_calls=2)
    text = "Compute it:\n```python\nprint(2 ** 10)\n```"
    assert blocks.call_end(text + "\nwhich prints 1000.\n```python\nprint(3)\n```") == len(text)  # the first
    assert blocks.call_end("```python\nprint(1)\n") is None  # not closed yet
    assert blocks.call_end("```\nprint(1)\n```") is None and blocks.call_end(call("print(1)")) is None
    assert blocks.answers(episode(text)) and not blocks.answers(episode("The answer is 1024."))
    turns = blocks.respond([episode(text), episode("```python\nraise ValueError('bad input')\n```"),
                            episode(text, text, text)])  # a third run past max_calls=2
    assert all(t.inline and t.message["role"] == "tool" for t in turns)
    assert turns[0].message["content"] == output_block("1024\n") == "\n```output\n1024\n```\n"
    assert turns[0].counts == {"tool_calls": 1, "tool_timeouts": 0, "tool_errors": 0}
    assert "ValueError: bad input" in turns[1].message["content"] and turns[1].counts["tool_errors"] == 1
    assert "no more tool calls" in turns[2].message["content"] and turns[2].counts["tool_errors"] == 1


def test_a_code_interpreter_s_prompt_renders_no_tools_and_its_turns_stop_only_at_the_model_s_own_tokens(tiny_model_dir):
    from grpo.training.models import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    for call_format, rendered in (("tool_call", True), ("code_block", False)):
        settings = TaskSettings.from_config(compose("grpo_tiny", ["env.tools=[python]", "env.max_turns=2",
                                                                  f"tools.call_format={call_format}"]))
        assert (env_tools(settings) is not None) == rendered
        closing = tok.encode("</tool_call>", add_special_tokens=False)
        assert (closing[0] in turn_stop_ids(settings, tok, [0])) == (rendered and len(closing) == 1)


class CutAtBang:
    """A user's environment whose turns end at their first "!" (``call_end``)."""
    max_turns, max_episode_tokens = 2, 100

    def answers(self, episode):
        return True

    def respond(self, episodes):
        return []

    def call_end(self, text):
        return text.index("!") + 1 if "!" in text else None


def test_a_user_environment_s_call_end_cuts_its_turns_through_the_one_line_guard():
    env = UserTurnEnv(CutAtBang(), "bang.py:CutAtBang")
    assert env.call_end("go! on") == 3 and env.call_end("go on") is None
    with pytest.raises(UserCodeError, match=r"env.turn_env='bang.py:CutAtBang': its call_end\(\) raised TypeError"):
        env.call_end(None)
    plain = type("Plain", (), {"max_turns": 2, "max_episode_tokens": 100, "answers": CutAtBang.answers,
                               "respond": CutAtBang.respond})
    assert not hasattr(UserTurnEnv(plain(), "plain.py:Plain"), "call_end")  # its turns end at stop tokens only
