"""Greedy evaluation on the held-out split, through the same env and reward as training."""

from __future__ import annotations

import time

import torch
from tqdm import tqdm


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


# shown on the console after eval/accuracy where the task reports them (all of them in metrics.jsonl)
EVAL_SHOWN = ("eval/strict_accuracy", "eval/flexible_accuracy", "eval/answer_rate", "eval/truncated_fraction")


class Evaluator:
    """Greedy held-out eval every ``eval.frequency`` steps and at the last, with this process's engine
    (the one that generates rollouts in sync, an eval-only one in async), given the trainer's weights first."""

    def __init__(self, cfg, env, engine, *, num_problems: int, fields: dict[str, str], stop_ids: list[int],
                 last_eval_step: int | None = None):
        self.env, self.engine, self.num_problems, self.fields, self.stop_ids = env, engine, num_problems, fields, stop_ids
        self.frequency, self.total_steps = cfg.eval.frequency, cfg.train.total_steps
        self.last_eval_step = last_eval_step

    def evaluate_if_due(self, step: int, trainer, logger, force: bool = False) -> None:
        due = force or (self.frequency and step % self.frequency == 0) or step == self.total_steps
        if not due or self.last_eval_step == step:
            return
        t0 = time.perf_counter()
        if self.engine.version != trainer.policy_version:  # rollout workers elsewhere got the weights, it did not
            self.engine.push_weights(trainer.engine_weights(), trainer.policy_version)
        result = evaluate(self.env, self.engine.greedy_policy, self.num_problems, self.fields, self.stop_ids)
        logger.log({"step": step, **result, "eval/time_s": time.perf_counter() - t0})
        shown = "".join(f" {name.removeprefix('eval/')} {result[name]:.3f}" for name in EVAL_SHOWN if name in result)
        tqdm.write(f"step {step}: eval accuracy {result['eval/accuracy']:.3f} "
                   f"({result['eval/num_problems']} problems){shown}, reply length {result['eval/response_length']:.0f}")
        self.last_eval_step = step
