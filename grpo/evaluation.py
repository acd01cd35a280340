"""Greedy evaluation on the held-out split, through the same env and reward as training."""

from __future__ import annotations

import torch


@torch.no_grad()
def evaluate(env, policy, num_problems: int, fields: dict[str, str]) -> dict:
    """Greedy replies to the first ``num_problems`` held-out prompts.

    ``fields`` maps eval metric names to the env's per-reply outputs (``success``, per-task
    accuracies); each is averaged over the problems (IFEval instruction-level accuracies are
    thus macro-averaged over prompts).
    """
    env.reset_dataloader()  # always the same problems, from the start of the split
    values = {name: [] for name in [*fields, "reward"]}
    lengths = []
    while len(lengths) < num_problems:
        td = env.step(policy(env.reset()))
        for name, key in [*fields.items(), ("reward", "reward")]:
            values[name] += td["next", key].flatten().float().tolist()
        lengths += [s["tokens", "response"].shape[-1] for s in td.unbind(0)]
    n = num_problems
    result = {f"eval/{name}": sum(v[:n]) / n for name, v in values.items()}
    return result | {"eval/response_length": sum(lengths[:n]) / n, "eval/num_problems": n}
