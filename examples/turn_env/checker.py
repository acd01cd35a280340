"""A multi-turn environment of your own: a simulated user who checks the model's answer format and asks once more.

Plugged in by config, with no edit to grpo/:

    python grpo/grpo.py --config-name grpo_tiny env.turn_env=examples/turn_env/checker.py:FormatChecker env.max_turns=2

The run calls ``answers`` after every assistant turn (does the environment speak now?) and ``respond`` with every
episode it answers at once; each answer is one message the chat template renders (``role``: ``user`` here,
``tool`` for a tool) and, optionally, counts under the names ``tool_calls``, ``tool_errors``, ``tool_timeouts`` and
``tool_failures`` (they reach metrics.jsonl). The episode's last assistant turn is what the reward scores; reward
functions may also take ``episode``, every message after the prompt.
"""

import re

from grpo.tasks.tool_env import EnvTurn

ANSWER = re.compile(r"<answer>\s*-?[\d,.]+\s*</answer>")


class FormatChecker:
    """Answers a turn that gives no final answer in a form the reward reads, once per episode."""

    def __init__(self, max_turns: int, max_episode_tokens: int):
        self.max_turns, self.max_episode_tokens = max_turns, max_episode_tokens

    def answers(self, episode) -> bool:
        asked = any(message["role"] == "user" for message in episode.messages)
        return not asked and ANSWER.search(episode.messages[-1]["content"]) is None

    def respond(self, episodes) -> list:
        return [EnvTurn({"role": "user", "content": "Give your final answer as <answer>N</answer>."})
                for _ in episodes]
