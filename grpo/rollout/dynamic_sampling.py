"""DAPO's dynamic sampling: a step trains on groups whose replies scored differently.

A group whose rewards are all equal gets advantage 0 on every reply: it adds no policy gradient,
only KL and entropy terms, yet costs its generation and training. With ``train.dynamic_sampling``
such groups are dropped and more prompt batches are generated (``draw``) until the step holds
``train.dialog_turns_per_batch`` replies of groups with distinct rewards, at most
``train.max_extra_generation_batches`` more a step. Past that bound the step is topped up with
dropped groups, so every step trains on the same number of replies (the LR schedule counts on it).
Groups beyond a full step are dropped; their prompt batches count as consumed like the rest, so a
resumed run draws exactly what an uninterrupted one would.

A draw may also be one generation batch larger than the step (``env.num_envs`` above
``train.dialog_turns_per_batch``): decoding is bound by per-token latency at these batch sizes, so
twice the replies cost less than a second batch. Real 0.5B on an H100: draws of 256 took generation
from 5.63 to 4.47 s a step (1.14 draws of 256 against 2.43 of 128); at the 1.5B shape 256 replies
took 1.54x the time of 128, no gain where 2.26 draws of 128 were needed (benchmarks/README.md).

Rewards are compared as the env gave them, before any KL or overlong shaping.
"""

from __future__ import annotations

from collections.abc import Callable

from grpo.rollout.settings import RolloutSettings
from grpo.training.batch import group_ids
from grpo.training.replies import Replies


def env_batches_per_draw(rollout: RolloutSettings) -> int:
    """The env batches (``env.num_envs`` replies each) one draw takes: enough for a step's replies, so one when a
    batch holds more than a step (dynamic sampling only: ``grpo.loop.config`` checks it)."""
    return -(-rollout.replies_per_step // rollout.num_envs)


def reply_groups(replies: Replies) -> list[list[int]]:
    """The replies of each group (``batch.group_ids``), in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, group in enumerate(group_ids(replies).tolist()):
        groups.setdefault(group, []).append(i)
    return list(groups.values())


def sort_groups(replies: Replies) -> tuple[list, list]:
    """The groups of ``replies`` (each a batch of its own): those whose rewards differ, those all alike."""
    informative, uniform = [], []
    for members in reply_groups(replies):
        rewards = replies.reward[members]
        (informative if rewards.max() > rewards.min() else uniform).append(replies.select(members))
    return informative, uniform


def draw_step_batch(draw: Callable, replies_per_step: int, *, dynamic: bool, max_extra_batches: int):
    """A step's rollouts and what the filter did. ``draw()`` returns the next batch of whole groups."""
    if not dynamic:
        rollouts = draw()
        informative, uniform = sort_groups(rollouts)
        return rollouts, {"uniform_group_fraction": len(uniform) / (len(informative) + len(uniform))}
    informative, uniform, extra = [], [], -1
    while sum(map(len, informative)) < replies_per_step and extra < max_extra_batches:
        more_informative, more_uniform = sort_groups(draw())
        informative, uniform, extra = informative + more_informative, uniform + more_uniform, extra + 1
    chosen, filled, uniform_used = [], 0, 0
    for i, group in enumerate(informative + uniform):  # informative groups first; dropped ones only to fill the step
        if filled + len(group) <= replies_per_step:
            chosen.append(group)
            filled += len(group)
            uniform_used += i >= len(informative)
    return Replies.cat(chosen), {
        "filtered_groups": len(uniform) - uniform_used,
        "uniform_group_fraction": len(uniform) / (len(informative) + len(uniform)),
        "extra_generation_batches": extra,
    }
