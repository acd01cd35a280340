"""The reference's log-probs of a step's replies, scored as early as the replies exist.

After the sampler returns a batch's tokens, the CPU still has work before the batch reaches the step: TorchRL's
wrapper decodes the replies into chat histories, the env scores them, the rows become ``Replies``. That is
~0.6 s at the 1.5B shape on an H100 host, with the GPU idle, against a ~0.5 s reference forward. So where the
engine samples in this process (``ref_model.score_early``: sync, one trainer rank, the transformers engine), the
sampler hands each sampled batch to ``score_early`` and a thread scores it with the reference while the main
thread does that CPU work; the step then takes each row's scores from there (``__call__``), matched by the row's
tokens, since dynamic sampling keeps only some groups of one or more batches. A row nobody scored early (vLLM,
rollout workers, several ranks) is scored then, as before.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from tensordict import TensorDict

from grpo.process.world import World
from grpo.training.batch import token_batch
from grpo.training.logprobs import ReplyLogProbs, score_replies


class ReferenceScores:
    """``scores, scored_early = reference(batch)``: the ``[S, R]`` log-probs of ``batch``'s replies under the
    reference (``scorer``), and how many rows were scored early (``score_early``)."""

    def __init__(self, scorer: ReplyLogProbs, settings, *, pad_token_id: int, stop_token_ids: list[int],
                 world: World = World()):
        self.scorer, self.s, self.world = scorer, settings, world
        self.pad_token_id, self.stop_token_ids = pad_token_id, stop_token_ids
        self.early: list[Future] = []  # each sampled batch's scores by row, until a step takes them
        self._thread = None

    def score_early(self, prompts: list[torch.Tensor], replies: list[torch.Tensor]) -> None:
        """A sampled batch as an engine returns it, each reply's prompt and reply ids (anything after a stop
        token is cut): scored on a thread while this one goes on."""
        if self._thread is None:  # one worker: batches are scored in the order they were sampled
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reference")
        self.early.append(self._thread.submit(self._rows_scored, prompts, replies))

    def _rows_scored(self, prompts: list[torch.Tensor], replies: list[torch.Tensor]) -> dict[tuple, torch.Tensor]:
        batch = token_batch(prompts, replies, self.pad_token_id, self.stop_token_ids)
        device = next(self.scorer.parameters()).device
        # the current CUDA device is a thread's own: the reference's, for anything not placed by its tensors
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            scores = score_replies(batch, self.scorer, self.s)
        return {key: row[:n] for key, row, n in zip(row_keys(batch), scores, batch["reply_length"].tolist())}

    def __call__(self, batch: TensorDict) -> tuple[torch.Tensor, int]:
        known: dict[tuple, torch.Tensor] = {}
        for scored in self.early:
            known |= scored.result()  # raises what the thread raised
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

