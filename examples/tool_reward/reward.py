"""A reward for using the Python tool well, to add to a tool task's own (docs/tools.md, "Keeping the tool").

The real Qwen2.5-Coder-0.5B stops calling the tool within 5-10 GRPO steps when only the final answer is paid
(benchmarks/README.md): most of its first calls are malformed, so episodes that call score lower than those that
do not. This pays an episode whose calls ran and printed something and which then gave its final answer. The
answer matters: paid for clean calls alone (2026-11-30, one H200, weights 0.1 and 0.5), the 0.5B learned within 13-20
steps to spend every turn on calls and never answer (2.4-2.9 calls an episode, 75-95% of episodes cut short, strict
accuracy 0.19 -> 0.00; docs/tools.md, "Keeping the tool").

    python grpo/grpo.py --config-name grpo_qwen05b_tools \
        'reward.functions=[examples/tool_reward/reward.py:ran_python]' 'reward.weights=[0.1]'

It is called once an episode with ``episode``: its messages after the prompt, the tool's answers among them as
``{"role": "tool", "content": ...}`` (what the sandbox printed, or the tool's own "Error: ..." line), and ``reply``:
its last assistant turn.
"""

from grpo.tasks.python_tool import holds_call
from grpo.tasks.rewards import marked_answer
from grpo.tasks.tool_env import NO_OUTPUT  # the tool's answer to a call that printed nothing

# how the tool's answer says a call did not run cleanly: its "Error: ..." line for a malformed or refused call
# (grpo/tasks/tool_env.py), the sandbox's markers and Python's traceback for a run that failed (grpo/tasks/sandbox.py)
REFUSED = "Error:"
FAILED = ("Traceback (most recent call last):", "[killed by ", "[exit status ", "[timed out after ")


def ran_python(episode: list[dict], reply: str) -> float:
    """1.0 when at least one of the episode's calls ran to a clean exit and printed something and the last turn is a
    final answer ("The answer is N" or another marked answer, no call): an episode cut at env.max_turns ends on a
    call and gets nothing. Else 0.0."""
    answered = not holds_call(reply) and marked_answer(reply) is not None
    return float(answered and any(message["role"] == "tool" and message["content"] != NO_OUTPUT
                     and not message["content"].startswith(REFUSED)
                     and not any(marker in message["content"] for marker in FAILED) for message in episode))
