"""The reference's log-probs of a step's replies, queued on the GPU as soon as the replies exist.

After the sampler returns a batch's tokens, the CPU still has work before the batch reaches the step: the policy
decodes the replies into chat histories, the env scores them, the rows become ``Replies``. That was ~0.6 s at the
1.5B shape on an H100 host (~0.24 s for 128 replies since the policy of ``grpo.inference.episode_policy``, bench_collection.py),
with the GPU idle, against a ~0.5 s reference forward. So where the engine samples in this process
(``ref_model.score_early``: sync, one trainer rank), it hands each sampled batch to ``score_early``, which queues
the reference's forward on the GPU and returns without waiting for it (packed rows:
``grpo.training.logprobs.queue_scores``); the CPU work then runs while the GPU scores. The step takes each row's
scores from there (``__call__``), matched by the row's tokens, since dynamic sampling keeps only some groups of
one or more batches. A row nobody scored early (rollout workers, several ranks) is scored then, as before.

A thread scoring the batch instead gained less than half of it (1.5B, H100: reference 0.52 -> 0.28 s, the
collection 0.16 s slower): it got the GIL only between the collection's own Python work.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch
from tensordict import TensorDict

from grpo.process.world import World
from grpo.training.batch import token_batch
from grpo.training.logprobs import ReplyLogProbs, gathered_scores, queue_scores, score_replies


class ReferenceScores:
    """``scores, scored_early = reference(batch)``: the ``[S, R]`` log-probs of ``batch``'s replies under the
    reference (``scorer``), and how many rows were scored early (``score_early``)."""

    def __init__(self, scorer: ReplyLogProbs, settings, *, pad_token_id: int, world: World = World()):
        self.scorer, self.world = scorer, world
        # without grad a forward keeps no activations: ref_model.micro_batch_tokens cuts by tokens alone, if set
        self.s = settings if settings.ref_micro_batch_tokens is None else replace(
            settings, micro_batch_size=sys.maxsize, micro_batch_tokens=settings.ref_micro_batch_tokens)
        self.pad_token_id = pad_token_id
        self.early: list[tuple] = []  # each sampled batch's row keys, reply lengths and queued scores
        # host seconds score_early took, inside the collection (generation_s): queuing the forward should not wait
        # for the GPU; if it does, this shows it (the step's reference_queue_s)
        self.queue_s = 0.0

    def score_early(self, prompts: list[torch.Tensor], replies: list[torch.Tensor]) -> None:
        """A sampled batch as the engine's policy hands it on, each episode's prompt and token ids: its scores
        queued on the reference's device (every episode token's: the step's mask keeps the sampled ones)."""
        start = time.perf_counter()
        batch = token_batch(prompts, replies, self.pad_token_id)
        self.early.append((row_keys(batch), batch["reply_length"].tolist(), batch["reply_mask"].shape,
                           queue_scores(batch, self.scorer, self.s)))
        self.queue_s += time.perf_counter() - start

    def __call__(self, batch: TensorDict) -> tuple[torch.Tensor, int]:
        known: dict[tuple, torch.Tensor] = {}
        for keys, lengths, shape, queued in self.early:
            scores = gathered_scores(queued, shape)
            known |= {key: row[:n] for key, row, n in zip(keys, scores, lengths)}
        self.early.clear()
        keys = row_keys(batch)
        missing = [i for i, key in enumerate(keys) if key not in known]
        if len(missing) == len(keys):  # nothing scored early: over several ranks, each scores its share
            return score_replies(batch, self.scorer, self.s, self.world), 0
        scores = torch.zeros(batch["reply_mask"].shape)
        if missing:
            scores[missing] = score_replies(batch[missing], self.scorer, self.s)
        for i, key in enumerate(keys):
            if key in known:
                scores[i, :known[key].numel()] = known[key]
        return scores * batch["reply_mask"], len(keys) - len(missing)


def row_keys(batch: TensorDict) -> list[tuple]:
    """Each row's identity: its prompt's length and its real tokens."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    return [(p, row[m].numpy().tobytes()) for p, row, m in zip(batch["prompt_length"].tolist(), ids, mask)]
