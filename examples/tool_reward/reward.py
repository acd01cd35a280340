"""A reward for using the Python tool well, to add to a tool task's own (docs/tools.md, "Keeping the tool").

The real Qwen2.5-Coder-0.5B stops calling the tool within 5-10 GRPO steps when only the final answer is paid
(benchmarks/README.md): most of its first calls are malformed, so episodes that call score lower than those that
do not. This pays an episode whose calls ran and printed something, whatever its answer:

    python grpo/grpo.py --config-name grpo_qwen05b_tools \
        'reward.functions=[examples/tool_reward/reward.py:ran_python]' 'reward.weights=[0.1]'

It is called once an episode with ``episode``: its messages after the prompt, the tool's answers among them as
``{"role": "tool", "content": ...}`` (what the sandbox printed, or the tool's own "Error: ..." line).
"""

# how the tool's answer says a call did not run cleanly (grpo/tasks/tool_env.py and grpo/tasks/sandbox.py write them)
REFUSED = ("Error:", "[no output")  # a malformed or refused call; a call that printed nothing
FAILED = ("Traceback (most recent call last):", "[killed by ", "[exit status ", "[timed out after ")


def ran_python(episode: list[dict]) -> float:
    """1.0 when at least one of the episode's calls ran to a clean exit and printed something, else 0.0."""
    return float(any(message["role"] == "tool" and not message["content"].startswith(REFUSED)
                     and not any(marker in message["content"] for marker in FAILED) for message in episode))
