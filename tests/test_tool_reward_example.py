"""examples/tool_reward: the tool-use reward scores the tool's real answers (the sandbox's, the tool env's)."""

import json

from grpo.tasks.sandbox import Sandbox
from grpo.tasks.tool_env import Episode, PythonToolEnv
from grpo.tasks.user_rewards import load_reward_function


def _call(code: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


CASES = {  # assistant turn -> whether ran_python pays the episode
    _call("print(6 * 7)"): 1.0,
    _call("1 / 0"): 0.0,                                    # a traceback
    _call("x = 6 * 7"): 0.0,                                # printed nothing
    _call("import sys; print(1); sys.exit(3)"): 0.0,        # printed, then a failing exit status
    _call("import time; time.sleep(30)"): 0.0,              # past tools.timeout_s
    '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"\n</tool_call>': 0.0,  # bad JSON
}


def test_ran_python_pays_only_a_clean_printing_call_then_an_answer():
    """Each case's assistant turn goes through the tool env and its sandbox; the episode they make (the turn, the
    tool's real answer, a final answer) is scored by the function as the run loads it from reward.functions."""
    reward = load_reward_function("examples/tool_reward/reward.py:ran_python", 0)
    sandbox = Sandbox()
    try:
        env = PythonToolEnv(sandbox, max_turns=4, max_episode_tokens=1024, max_calls=4)
        turns = list(CASES)
        answers = env.respond([Episode([], [{"role": "assistant", "content": turn}], 0) for turn in turns])
    finally:
        sandbox.close()
    episodes = [[{"role": "assistant", "content": turn}, answer.message,
                 {"role": "assistant", "content": "The answer is 42."}] for turn, answer in zip(turns, answers)]
    scores = reward([{"episode": e, "reply": e[-1]["content"], "prompt": "q"} for e in episodes],
                    list(range(len(episodes))), "test", timeout_s=60)
    assert scores == list(CASES.values()), [(a.message["content"][:60], s) for a, s in zip(answers, scores)]
    # one clean run among failed ones pays an answered episode; an episode without a call gets nothing, nor one
    # that ends on a call (cut at env.max_turns) or on a turn without a marked answer
    clean, failed = episodes[0][:2], episodes[1][:2]
    answered = {"role": "assistant", "content": "The answer is 42."}
    cases = [(failed + clean + [answered], 1.0),
             ([answered], 0.0),
             (clean + [{"role": "assistant", "content": turns[0]}], 0.0),
             (clean + [{"role": "assistant", "content": "so it is 42"}], 0.0)]
    scores = reward([{"episode": e, "reply": e[-1]["content"], "prompt": "q"} for e, _ in cases],
                    list(range(len(cases))), "test", timeout_s=60)
    assert scores == [paid for _, paid in cases]
