"""Evaluation on the held-out split, through the same env and reward as training: greedy, and with
``eval.samples_per_problem`` k > 1 also k sampled replies a problem (pass@k, avg@k)."""

from __future__ import annotations

import math
import statistics
import time

import torch

from grpo.loop.logger import eval_reply_rows
from grpo.loop.settings import EvalSettings
from grpo.process.console import say
from grpo.tasks.envs import make_env
from grpo.tasks.settings import TaskSettings
from grpo.training.replies import Replies

@torch.no_grad()
def evaluate(env, policy, num_problems: int, fields: dict[str, str]) -> tuple[dict, list[float], Replies]:
    """Greedy replies to the first ``num_problems`` held-out prompts: the eval row, each problem's score
    (``eval/accuracy``'s, in problem order) and the episodes, in the same order.

    ``fields`` maps eval metric names to the env's per-reply outputs (``success``, per-task
    accuracies); each is averaged over the problems (IFEval instruction-level accuracies are
    thus macro-averaged over prompts). Reply length (the model's own tokens), the share of episodes cut short of
    a final answer, turns and tool calls per episode come with them: a recipe that collapses to short or
    endless replies, or stops calling its tool, shows here. ``eval/accuracy_stderr`` is the accuracy's standard
    error over the problems.
    """
    env.reset_dataloader()  # always the same problems, from the start of the split
    values = {name: [] for name in [*fields, "reward"]}
    batches = []
    while sum(len(batch.user_prompts) for batch in batches) < num_problems:
        td = env.step(policy(env.reset()))
        batches.append(Replies.from_collector(td))
        for name, key in [*fields.items(), ("reward", "reward")]:
            values[name] += td["next", key].flatten().float().tolist()
    n = num_problems
    replies = Replies.cat(batches).select(list(range(n)))
    episode = {"response_length": [int(mask.sum()) for mask in replies.sampled_masks()],
               "truncated_fraction": replies.truncated.float().tolist(), "turns": replies.turns.tolist(),
               "tool_calls_per_episode": replies.tool_calls.tolist()}
    result = {f"eval/{name}": sum(v[:n]) / n for name, v in values.items()}
    result |= {f"eval/{name}": sum(v) / n for name, v in episode.items()}
    result["eval/tool_error_rate"] = sum(replies.tool_errors.tolist()) / max(sum(episode["tool_calls_per_episode"]), 1)
    scores = values[next(iter(fields))][:n]
    return result | {"eval/accuracy_stderr": standard_error(scores), "eval/num_problems": n}, scores, replies


@torch.no_grad()
def sampled_eval(env, policy, num_problems: int, k: int, field: str) -> dict:
    """``k`` sampled replies to each of the first ``num_problems`` held-out prompts (``env`` repeats each prompt k
    times), scored by the env's ``field`` (``eval/accuracy``'s): ``eval/pass@k``, the share of problems one of them
    solves, and ``eval/avg@k``, the share of replies that do (the unbiased pass@1), each with its standard error."""
    env.reset_dataloader()
    solved: dict[int, list[bool]] = {}  # by data row, in problem order
    while len(solved) < num_problems:
        td = env.step(policy(env.reset()))
        for row, score in zip(td["row_index"].flatten().tolist(), td["next", field].flatten().tolist()):
            if len(replies := solved.setdefault(row, [])) < k:  # a last batch past the split's end starts it again
                replies.append(score > 0.5)
    problems = list(solved.values())[:num_problems]
    passed = [pass_at_k(len(p), sum(p), k) for p in problems]
    average = [sum(p) / len(p) for p in problems]
    return {f"eval/pass@{k}": sum(passed) / len(passed), f"eval/pass@{k}_stderr": standard_error(passed),
            f"eval/avg@{k}": sum(average) / len(average), f"eval/avg@{k}_stderr": standard_error(average)}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021)'s unbiased pass@k from ``n`` samples of which ``c`` are correct: the chance that ``k`` of
    them, drawn without replacement, hold a correct one: 1 - C(n-c, k) / C(n, k). With n = k, as the sampled eval
    draws, it is 1 where any sample is correct; n > k lowers its variance."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def standard_error(values: list[float]) -> float:
    """Of the mean of ``values`` (0 for fewer than two)."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


def gain_since(first: tuple[int, list[float]] | None, scores: list[float]) -> dict:
    """The accuracy gained since ``first`` (its step and per-problem scores) on the same problems, with the
    paired standard error: that of the per-problem differences, so problems solved (or missed) both times add
    no noise, as they do to the two evals' own errors."""
    if first is None or len(first[1]) != len(scores):
        return {}
    differences = [after - before for before, after in zip(first[1], scores)]
    return {"eval/gain": sum(differences) / len(differences), "eval/gain_stderr": standard_error(differences),
            "eval/gain_since_step": first[0]}


def gain_text(row: dict) -> str:
    """``+9.0 ± 2.1 points since step 0``: an eval row's gain, as ``gain_since`` gave it ("" where it has none)."""
    if "eval/gain" not in row:
        return ""
    return (f"{100 * row['eval/gain']:+.1f} ± {100 * row['eval/gain_stderr']:.1f} points since step "
            f"{row['eval/gain_since_step']}")


# shown on the console after eval/accuracy where the task reports them (all of them in metrics.jsonl)
EVAL_SHOWN = ("eval/strict_accuracy", "eval/flexible_accuracy", "eval/answer_rate", "eval/truncated_fraction")


class Evaluator:
    """Held-out eval every ``eval.frequency`` steps and at the last (greedy, then sampled where
    ``eval.samples_per_problem`` > 1), with this process's engine (the one that generates rollouts in sync, an
    eval-only one in async), given the trainer's weights first."""

    def __init__(self, settings: EvalSettings, task: TaskSettings, tokenizer, engine, *, num_problems: int,
                 fields: dict[str, str], last_eval_step: int | None = None):
        self.engine, self.num_problems, self.fields, self.tokenizer = engine, num_problems, fields, tokenizer
        self.save_replies = settings.save_replies
        self.frequency, self.total_steps = settings.frequency, settings.total_steps
        self.last_eval_step, self.evaluated = last_eval_step, False
        prompts = min(settings.batch_size, num_problems)
        self.env = make_env(task, tokenizer, split=task.test_split, repeats=1, num_envs=prompts, shuffle=False)
        self.k = settings.samples_per_problem
        # as many replies a batch as the greedy eval's (its memory), from a k-th of the prompts
        self.sampled_env = make_env(task, tokenizer, split=task.test_split, repeats=self.k, shuffle=False,
                                    num_envs=self.k * max(1, prompts // self.k)) if self.k > 1 else None

    def evaluate_if_due(self, step: int, trainer, logger, force: bool = False) -> dict | None:
        """The eval row, when one was due."""
        due = force or (self.frequency and step % self.frequency == 0) or step == self.total_steps
        if not due or self.last_eval_step == step:
            return None
        if not self.evaluated:  # this process's first: a first generation (and compile) takes longest
            sampled = f", then {self.k} sampled replies each" if self.sampled_env is not None else ""
            say(f"step {step}: evaluating on {self.num_problems} held-out problems (greedy{sampled})")
        t0 = time.perf_counter()
        if self.engine.version != trainer.policy_version:  # rollout workers elsewhere got the weights, it did not
            self.engine.push_weights(trainer.engine_weights(), trainer.policy_version)
        result, scores, replies = evaluate(self.env, self.engine.greedy_policy, self.num_problems, self.fields)
        result |= gain_since(logger.first_eval_scores(), scores)
        if self.sampled_env is not None:
            result |= sampled_eval(self.sampled_env, self.engine.sampled_eval_policy, self.num_problems, self.k,
                                   next(iter(self.fields.values())))
        logger.log({"step": step, **result, "eval/time_s": time.perf_counter() - t0})
        logger.log_eval_scores(step, scores)
        if self.save_replies:
            logger.log_eval_replies(step, eval_reply_rows(replies, scores, self.tokenizer))
        names = [*EVAL_SHOWN, f"eval/pass@{self.k}", f"eval/avg@{self.k}"]
        shown = "".join(f" {name.removeprefix('eval/')} {result[name]:.3f}" for name in names if name in result)
        gain = f", {gain_text(result)} (same problems)" if "eval/gain" in result else ""
        if result["eval/tool_calls_per_episode"] or result["eval/turns"] > 1:
            shown += (f" turns {result['eval/turns']:.2f} tool_calls {result['eval/tool_calls_per_episode']:.2f} "
                      f"tool_errors {result['eval/tool_error_rate']:.2f}")
        say(f"step {step}: eval accuracy {result['eval/accuracy']:.3f} ± {result['eval/accuracy_stderr']:.3f} "
            f"({result['eval/num_problems']} problems){gain}{shown}, reply length {result['eval/response_length']:.0f}")
        self.last_eval_step, self.evaluated = step, True
        return result
