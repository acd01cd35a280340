"""Reward functions for examples/my_task (README, "Your own task").

Each is called once per reply with the arguments it names: ``prompt`` (the row's question),
``reply`` (the model's text) and any column of the row (here ``answer``), and returns a float.
"""

import re


def correct(reply: str, answer: int) -> float:
    """1.0 when the last number in the reply is the row's answer."""
    numbers = re.findall(r"-?\d+", reply)
    return float(bool(numbers) and int(numbers[-1]) == answer)


def tagged(reply: str) -> float:
    """1.0 when the reply ends with its answer inside <answer></answer>."""
    return float(re.search(r"<answer>[^<]+</answer>\s*$", reply) is not None)
