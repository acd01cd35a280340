"""Greedy evaluation on the held-out split, through the same env and reward as training."""

from __future__ import annotations

import torch


@torch.no_grad()
def evaluate(env, policy, num_problems: int, fields: dict[str, str], stop_ids: list[int]) -> dict:
    """Greedy replies to the first ``num_problems`` held-out prompts.

    ``fields`` maps eval metric names to the env's per-reply outputs (``success``, per-task
    accuracies); each is averaged over the problems (IFEval instruction-level accuracies are
    thus macro-averaged over prompts). Reply length and the share of replies cut at the token cap
    (their last token is none of ``stop_ids``) come with them: a recipe that collapses to short or
    endless replies shows here.
    """
    env.reset_dataloader()  # always the same problems, from the start of the split
    values = {name: [] for name in [*fields, "reward"]}
    lengths, truncated = [], []
    while len(lengths) < num_problems:
        td = env.step(policy(env.reset()))
        for name, key in [*fields.items(), ("reward", "reward")]:
            values[name] += td["next", key].flatten().float().tolist()
        for reply in (s["tokens", "response"] for s in td.unbind(0)):
            lengths.append(reply.shape[-1])
            truncated.append(reply.numel() == 0 or int(reply[-1]) not in stop_ids)
    n = num_problems
    result = {f"eval/{name}": sum(v[:n]) / n for name, v in values.items()}
    return result | {"eval/response_length": sum(lengths[:n]) / n, "eval/truncated_fraction": sum(truncated[:n]) / n,
                     "eval/num_problems": n}
