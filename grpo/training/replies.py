"""``Replies``: a batch of grouped replies as a rollout source hands it to the trainer.

TorchRL's collector returns a lazy stack of per-reply tensordicts: chat histories, texts, tokens, masks,
log-probs and every reward term, ragged and nested. Ray pickled it tensordict by tensordict: 128 replies
x 512 tokens were 3.85 MB, 0.18 s to pickle on the worker and 0.21 s to unpickle on the trainer, which
waits for it (``benchmarks/bench_batch_transfer.py``, CPU), and tensordict 0.14.3's ``consolidate()`` of
such a stack cannot be unpickled. The trainer reads a few fields only, so both rollout sources turn
the collector's batch into this form (``from_collector``), and everything after them (dynamic
sampling, the samples shown, the dense training batch, the other ranks under torchrun) reads it:

A reply is a whole episode (``grpo.inference.episode_policy``): its assistant turns and the environment's turns
between them, one token sequence.

    prompt_tokens    [sum P_i] int64    every prompt's token ids, one after another; prompt_lengths [N]
    reply_tokens     [sum R_i] int64    every episode's ids after its prompt (each turn through its stop token);
                                        reply_lengths [N]
    reply_log_probs  [sum R_i] float32  the sampler's log-prob of each episode token (0 for the environment's)
    sampled_mask     [sum R_i] bool     True where the engine sampled the token: what the loss trains on
    reward           [N] float32        the env's reward at the episode's end
    success          [N] bool           the env's success flag at the episode's end
    truncated        [N] bool           the episode ended short of a final answer (turns, reply cap or budget)
    turns            [N] int64          assistant turns taken
    tool_calls, tool_errors, tool_timeouts, tool_failures
                     [N] int64          what the turn environment counted (failures: the sandbox's own)
    row_index        [N] int64          the data row its prompt came from
    user_prompts     N str              its prompt's last user message, as the chat history holds it

Pickled, the tensors travel as numpy arrays: raw buffers, which Ray's object store passes outside the
pickle stream. 128 x 512 on a CPU: 0.91 MB, 0.2 ms to pickle and 0.1 ms to unpickle (ray.put 1.6 ms,
ray.get 0.3 ms), after 20 ms to convert on the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from grpo.tasks.tool_env import EPISODE_COUNTS

EPISODE_FIELDS = ("truncated", "turns", *EPISODE_COUNTS)
TENSORS = ("prompt_tokens", "prompt_lengths", "reply_tokens", "reply_lengths", "reply_log_probs", "sampled_mask",
           "reward", "success", "row_index", *EPISODE_FIELDS)


@dataclass
class Replies:
    prompt_tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    reply_tokens: torch.Tensor
    reply_lengths: torch.Tensor
    reply_log_probs: torch.Tensor
    sampled_mask: torch.Tensor
    reward: torch.Tensor
    success: torch.Tensor
    row_index: torch.Tensor
    user_prompts: list[str]
    truncated: torch.Tensor
    turns: torch.Tensor
    tool_calls: torch.Tensor
    tool_errors: torch.Tensor
    tool_timeouts: torch.Tensor
    tool_failures: torch.Tensor

    @classmethod
    def from_collector(cls, rollouts) -> Replies:
        """The collector's batch (any batch shape: one reply per element)."""
        rollouts = rollouts.reshape(-1)
        n = rollouts.batch_size[0]
        history = rollouts.get(("history", "prompt"))
        return cls.from_sequences(
            prompts=rollouts.get(("tokens", "prompt"), as_list=True),
            replies=rollouts.get(("tokens", "response"), as_list=True),
            log_probs=rollouts.get(("log_probs", "response"), as_list=True),
            sampled_masks=rollouts.get(("episode", "sampled_mask"), as_list=True),
            reward=rollouts.get(("next", "reward")).reshape(n, -1)[:, -1],
            success=rollouts.get(("next", "success")).reshape(n, -1)[:, -1],
            row_index=rollouts.get("row_index").reshape(n),
            user_prompts=[last_user_message(roles, texts) for roles, texts in zip(history.role, history.content)],
            **{name: rollouts.get(("episode", name)).reshape(n) for name in EPISODE_FIELDS})

    @classmethod
    def from_sequences(cls, *, prompts, replies, log_probs, reward, success, row_index, user_prompts,
                       sampled_masks=None, truncated=None, turns=None, **counts) -> Replies:
        """From one token tensor (or list) per prompt, episode, its log-probs and sampled mask (None: all sampled),
        and the per-episode rest (``truncated``, None: none; ``turns``, None: one each; ``EPISODE_COUNTS``: 0)."""
        prompts, replies = [torch.as_tensor(p).long() for p in prompts], [torch.as_tensor(r).long() for r in replies]
        log_probs = [torch.as_tensor(lp).float() for lp in log_probs]
        if sampled_masks is None:
            sampled_masks = [torch.ones(r.numel(), dtype=torch.bool) for r in replies]
        sampled_masks = [torch.as_tensor(m).bool() for m in sampled_masks]
        for i, (reply, lp, mask) in enumerate(zip(replies, log_probs, sampled_masks, strict=True)):
            if lp.numel() != reply.numel() or mask.numel() != reply.numel():
                raise ValueError(f"reply {i} has {reply.numel()} tokens but {lp.numel()} sampler log-probs and "
                                 f"{mask.numel()} sampled marks: an engine returns one log-prob per reply token")
        n = len(replies)
        per_episode = {"truncated": torch.zeros(n, dtype=torch.bool) if truncated is None else truncated,
                       "turns": torch.ones(n, dtype=torch.long) if turns is None else turns}
        per_episode |= {name: counts.get(name, torch.zeros(n, dtype=torch.long)) for name in EPISODE_COUNTS}
        return cls(prompt_tokens=torch.cat(prompts), prompt_lengths=torch.tensor([p.numel() for p in prompts]),
                   reply_tokens=torch.cat(replies), reply_lengths=torch.tensor([r.numel() for r in replies]),
                   reply_log_probs=torch.cat(log_probs), sampled_mask=torch.cat(sampled_masks),
                   reward=torch.as_tensor(reward).float(), success=torch.as_tensor(success).bool(),
                   row_index=torch.as_tensor(row_index).long(), user_prompts=list(user_prompts),
                   truncated=torch.as_tensor(per_episode["truncated"]).bool(),
                   **{name: torch.as_tensor(per_episode[name]).long() for name in ("turns", *EPISODE_COUNTS)})

    def __len__(self) -> int:
        return len(self.reward)

    def prompts(self) -> list[torch.Tensor]:
        """Each reply's prompt token ids (views)."""
        return list(self.prompt_tokens.split(self.prompt_lengths.tolist()))

    def replies(self) -> list[torch.Tensor]:
        """Each reply's token ids (views)."""
        return list(self.reply_tokens.split(self.reply_lengths.tolist()))

    def log_probs(self) -> list[torch.Tensor]:
        """Each reply's sampler log-probs (views)."""
        return list(self.reply_log_probs.split(self.reply_lengths.tolist()))

    def sampled_masks(self) -> list[torch.Tensor]:
        """Each episode's sampled marks (views)."""
        return list(self.sampled_mask.split(self.reply_lengths.tolist()))

    def select(self, rows: list[int]) -> Replies:
        """The replies at ``rows``, in that order."""
        prompts, replies, log_probs, masks = self.prompts(), self.replies(), self.log_probs(), self.sampled_masks()
        index = torch.tensor(rows, dtype=torch.long)
        return Replies.from_sequences(prompts=[prompts[i] for i in rows], replies=[replies[i] for i in rows],
                                      log_probs=[log_probs[i] for i in rows], sampled_masks=[masks[i] for i in rows],
                                      reward=self.reward[index], success=self.success[index],
                                      row_index=self.row_index[index], user_prompts=[self.user_prompts[i] for i in rows],
                                      **{name: getattr(self, name)[index] for name in EPISODE_FIELDS})

    @staticmethod
    def cat(parts: list[Replies]) -> Replies:
        """One batch of ``parts``' replies, in order."""
        if len(parts) == 1:
            return parts[0]
        return Replies(**{name: torch.cat([getattr(p, name) for p in parts]) for name in TENSORS},
                       user_prompts=[text for p in parts for text in p.user_prompts])

    def __getstate__(self) -> dict:
        return {f.name: getattr(self, f.name).numpy() if f.name in TENSORS else getattr(self, f.name)
                for f in fields(self)}

    def __setstate__(self, state: dict) -> None:
        # Ray's object store hands arrays back read-only; a copy (about 1 MB) makes them the tensors' own
        for name, value in state.items():
            setattr(self, name, torch.from_numpy(np.array(value)) if name in TENSORS else value)


def last_user_message(roles, texts) -> str:
    """The last message whose role is ``user`` in one chat history."""
    return next((text for role, text in zip(reversed(roles), reversed(texts)) if role == "user"), "")
