"""A reward for using the Python tool well, to add to a tool task's own (docs/tools.md, "Keeping the tool").

The real Qwen2.5-Coder-0.5B stops calling the tool within 5-10 GRPO steps when only the final answer is paid
(benchmarks/README.md): most of its first calls are malformed, so episodes that call score lower than those that
do not. This pays an episode whose calls ran and printed something, whatever its answer:

    python grpo/grpo.py --config-name grpo_qwen05b_tools \
        'reward.functions=[examples/tool_reward/reward.py:ran_python]' 'reward.weights=[0.1]'

It is called once an episode with ``episode``: its messages after the prompt, the tool's answers among them as
``{"role": "tool", "content": ...}`` (what the sandbox printed, or the tool's own "Error: ..." line).
"""

from grpo.tasks.tool_env import NO_OUTPUT  # the tool's answer to a call that printed nothing

# how the tool's answer says a call did not run cleanly: its "Error: ..." line for a malformed or refused call
# (grpo/tasks/tool_env.py), the sandbox's markers and Python's traceback for a run that failed (grpo/tasks/sandbox.py)
REFUSED = "Error:"
FAILED = ("Traceback (most recent call last):", "[killed by ", "[exit status ", "[timed out after ")


def ran_python(episode: list[dict]) -> float:
    """1.0 when at least one of the episode's calls ran to a clean exit and printed something, else 0.0."""
    return float(any(message["role"] == "tool" and message["content"] != NO_OUTPUT
                     and not message["content"].startswith(REFUSED)
                     and not any(marker in message["content"] for marker in FAILED) for message in episode))
