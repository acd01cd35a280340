"""Continuous batching across turns: our decode loop samples a batch of episodes to their ends in one decode batch.

Sampled by turns, a batch of episodes decodes every turn until its longest reply ends, waits for the tool, then
decodes the next turn of those that go on from a fresh prefill, in a decode batch of another shape (one more compiled
graph). Here an episode's turn ends when it ends (a stop token, its room, or a code interpreter's call: its text is
checked as it grows), the environment answers it in the background while the other rows decode, and its next turn
joins the batch so that its context's last token sits just before the batch's shared slot (the slots before the
context are masked, and the filled-slot attention starts after them): in the row its last turn decoded in, kept for
it, whose cache already holds the context up to that turn (moved along the row, only the environment's tokens run
through the model); or, where a compaction gave that row up, in a free row, the whole context prefilled.

Measured with ``benchmarks/bench_turns.py`` (one H200, the real Qwen2.5-Coder-0.5B as a code interpreter, 256
episodes, the same batches each way): with up to 4 turns, 1,230 decode steps against 2,044 and 6.7 s a batch against
28.2 (by turns, each turn's new shapes compiled again); with 2 turns, 3.19 s against 3.18, the longest episode's two
turns being about as long as the two longest turns. A whole training run with 2 turns: 9.3 s a step against 10.2, the
sandbox's calls under the decoding.

Every ``STOP_CHECK_EVERY`` tokens the host reads which rows ended. An answer is taken ``ANSWER_WAIT_CHECKS`` checks
after its turn ended, waiting for it then if it is late, and turns join at every ``JOIN_EVERY_CHECKS``-th check:
which turn joins when does not depend on how fast the tool ran, so a seeded run samples the same episodes again. A
turn that would not fit in what is left of the batch's decode (``stream_steps``) waits for the next batch of the
same call, with the episodes that ended up there. A task of one turn has nothing to join: it samples by turns, the
plain decode loop (``ReplySampler.sample``).
"""

from __future__ import annotations

import time

import torch

from grpo.inference.decoding import STOP_CHECK_EVERY, ReplySampler, compacted_size
from grpo.inference.episode_policy import pad_prompts
from grpo.inference.episodes import EpisodeBatch

# checks between a turn's end and its answer's being taken: 16 tokens, 60-100 ms of decoding a batch of 256 at 0.5B-1.5B
# on an H200, about what a sandboxed call takes (benchmarks/README.md: ~65 ms on the CPU)
ANSWER_WAIT_CHECKS = 2
# checks between two joins: each prefills its turns' contexts, a forward launched from Python (~45 ms at 0.5B on an
# H200 host, whatever its rows). 2 turns, 256 episodes, a batch against 3.18 s by turns: every 1: 8.0 s, 4: 4.24,
# 8: 3.41, 16: 3.19 (bench_turns)
JOIN_EVERY_CHECKS = 16


def stream_steps(batch: EpisodeBatch, max_new_tokens: int) -> int:
    """The tokens a batch of the episodes decodes at most: every turn's reply cap (within the episode's budget and
    one more cap), and each answer's wait."""
    waits = (batch.max_turns - 1) * (ANSWER_WAIT_CHECKS + 1) * STOP_CHECK_EVERY
    return min(batch.max_turns * max_new_tokens, batch.budget + max_new_tokens) + waits


def sample_continuously(sampler: ReplySampler, batch: EpisodeBatch, options: dict) -> None:
    """Every episode of ``batch`` sampled to its end with ``options`` (``generate_kwargs``), in as few decode batches
    as fit."""
    start, env_before = time.perf_counter(), batch.policy.env_seconds
    with sampler.fused(), torch.no_grad():
        going = list(range(len(batch)))
        while going:
            going = decode_batch(sampler, batch, going, options)
    # the engine's seconds: its decoding, without the waits on the environment (counted there)
    sampler.seconds += time.perf_counter() - start - (batch.policy.env_seconds - env_before)


class Rows:
    """The host's view of a decode batch: each row's episode (None: free), the step its turn started at, the most
    tokens it may take, (for a turn environment with calls) its turn's text so far, and the slot its context starts
    at. ``held``: the episodes waiting for an answer whose rows are kept for them, each row and how many tokens of
    the episode's context its cache holds: their next turns join there, only what was added since run through the
    model (``Prefill.extend_rows``: a batch of 256 of the real 0.5B's code-interpreter episodes joins in 0.66 s
    against 0.75 with whole contexts prefilled again, one H200, where a join's eager launches dominate; 0.028 against
    0.103 s, the tiny tool task on 2 CPU cores)."""

    def __init__(self, size: int):
        self.episode: list[int | None] = [None] * size
        self.started, self.room, self.text, self.first = [0] * size, [0] * size, [""] * size, [0] * size
        self.held: dict[int, tuple[int, int]] = {}

    def live(self) -> list[int]:
        return [r for r, i in enumerate(self.episode) if i is not None]

    def free(self) -> list[int]:
        kept = {r for r, _ in self.held.values()}
        return [r for r, i in enumerate(self.episode) if i is None and r not in kept]

    def take(self, order: list[int], size: int) -> None:
        """The batch compacted: its row ``j`` is the old row ``order[j]``, the rest free (held rows too: their
        episodes' next turns are prefilled whole)."""
        free = size - len(order)
        self.episode = [self.episode[r] for r in order] + [None] * free
        self.started = [self.started[r] for r in order] + [0] * free
        self.room = [self.room[r] for r in order] + [0] * free
        self.text = [self.text[r] for r in order] + [""] * free
        self.first = [self.first[r] for r in order] + [0] * free
        self.held.clear()


def decode_batch(sampler: ReplySampler, batch: EpisodeBatch, going: list[int], options: dict) -> list[int]:
    """Episodes ``going`` sampled from their contexts in one decode batch, later turns joining it as their answers
    come back; returns those whose next turn did not fit in it."""
    pad, stop_ids, device = options["pad_token_id"], list(options["eos_token_id"]), sampler.model.device
    sampling = sampler.sampling(do_sample=options["do_sample"], temperature=options.get("temperature", 1.0),
                                top_p=options.get("top_p", 1.0), top_k=options.get("top_k", 0))
    contexts = [batch.context(i) for i in going]
    size = sampler.decode_rows(len(going), len(batch))
    contexts += [contexts[-1]] * (size - len(going))
    input_ids, attention_mask = pad_prompts(contexts, pad)
    # slots left free before the prompts: a later turn's context, the environment's tokens in it, fits behind the
    # batch's slot when it joins (the tiny tool task's answers outgrew it: every second turn waited for a batch of its own)
    headroom = max(batch.budget - options["max_new_tokens"], 0) if batch.max_turns > 1 else 0
    input_ids = torch.nn.functional.pad(input_ids, (headroom, 0), value=pad)
    attention_mask = torch.nn.functional.pad(attention_mask, (headroom, 0))
    steps, prompt_len = stream_steps(batch, options["max_new_tokens"]), input_ids.shape[1]
    buf, cache, step = sampler.begin(input_ids.to(device), attention_mask, steps, stop_ids, pad, sampling)
    buf.done[len(going):] = True
    rows = Rows(size)
    for r, i in enumerate(going):
        rows.episode[r], rows.room[r], rows.first[r] = i, batch.room(i), prompt_len - contexts[r].numel()
    sampler.batch_sizes = [size]
    ready, later, generated, checked = [], [], 1, 0
    while True:
        if generated % STOP_CHECK_EVERY == 0 or generated == steps:
            slot = prompt_len + generated - 1  # where the next step writes: the first token came from the prefill
            end_turns(sampler, batch, rows, buf, generated, checked, slot, pad)
            checked = generated
            live = len(rows.live())
            ready += batch.answers(after=ANSWER_WAIT_CHECKS if live else 0)
            pending = batch.pending()
            going_on = pending | set(ready)  # a held episode answered with no room left ends: its row is freed
            rows.held = {i: held for i, held in rows.held.items() if i in going_on}
            joined = []
            if not live or (generated // STOP_CHECK_EVERY) % JOIN_EVERY_CHECKS == 0:
                joined, ready, late = join(sampler, batch, rows, buf, cache, ready, slot, generated, steps, pad)
                later += late
            if not live and not joined:
                return later + ready
            needed = len(rows.live()) + len(ready) + len(pending)  # a join takes no answers: still pending
            smaller = compacted_size(len(rows.episode), needed) if sampler.compact_rows else None
            if smaller is not None:
                order = rows.live()
                buf, cache, step, _ = sampler.compact(buf, cache, None, smaller, steps, stop_ids, pad, sampling)
                rows.take(order, smaller)
        step()
        generated += 1


def end_turns(sampler: ReplySampler, batch: EpisodeBatch, rows: Rows, buf, generated: int, checked: int, slot: int,
              pad: int) -> None:
    """The turns that ended since the last check (at ``checked``) handed to ``batch``, their rows freed or, where
    the episode waits for an answer, held for it: a stop token, the turn's room spent, or a call whole in its text.
    Every slot before ``slot`` has been written."""
    done = buf.done.tolist()
    live = rows.live()
    ended = [r for r in live if done[r] or generated - rows.started[r] >= rows.room[r]]
    if batch.call_end is not None:
        over = set(ended)
        going = [r for r in live if r not in over]
        if going:
            window = buf.tokens[going, checked:generated].cpu()
            for r, text in zip(going, decode(batch, window), strict=True):
                rows.text[r] += text
                if batch.turn_over(rows.text[r]):  # read window by window: checked on the whole turn's tokens
                    rows.text[r] = decode(batch, buf.tokens[[r], rows.started[r]:generated].cpu())[0]
                    if batch.turn_over(rows.text[r]):
                        ended.append(r)
    if not ended:
        return
    index = torch.tensor(ended, device=buf.done.device)
    tokens, log_probs = buf.tokens[index, :generated].cpu(), buf.log_probs[index, :generated].cpu()
    buf.done[index] = True
    for k, r in enumerate(ended):
        reply, lp = tokens[k, rows.started[r]:], log_probs[k, rows.started[r]:]
        keep = reply != pad  # a sampled pad ends a reply, as a finished row's padding does
        i = rows.episode[r]
        if batch.end_turn(i, reply[keep], lp[keep]):  # its context as far as the row's cache holds it
            rows.held[i] = (r, min(batch.context(i).numel(), slot - rows.first[r]))
        rows.episode[r], rows.text[r] = None, ""


def decode(batch: EpisodeBatch, window: torch.Tensor) -> list[str]:
    """Each row's tokens as text."""
    return batch.policy.tokenizer.batch_decode(window, skip_special_tokens=False)


def join(sampler: ReplySampler, batch: EpisodeBatch, rows: Rows, buf, cache, ready: list[int], slot: int,
         generated: int, steps: int, pad: int) -> tuple[list[int], list[int], list[int]]:
    """Episodes ``ready`` to sample their next turn put in the rows held for them (only the tokens added since their
    last turn run through the model) or in free rows (their whole contexts), as many as there are: each context's
    keys and values written to its row, its last token fed by the next step at ``slot``. Returns those that joined,
    those that wait for a free row or for the batch's slot to pass their context's length, and those whose turn no
    longer fits in the batch's ``steps`` (their held rows freed)."""
    free = rows.free()
    fresh, extended, waiting, late = [], [], [], []  # (row, episode, context); extended: and the tokens held
    for i in ready:
        context, held = batch.context(i), rows.held.get(i)
        if generated + batch.room(i) > steps:
            late.append(i)
            rows.held.pop(i, None)
        elif context.numel() - 1 > slot:
            waiting.append(i)
        elif held is not None:
            extended.append((held[0], i, context, held[1]))
            del rows.held[i]
        elif free:
            fresh.append((free.pop(0), i, context))
        else:
            waiting.append(i)
    if not fresh and not extended:
        return [], waiting, late
    device = buf.done.device
    if fresh:
        input_ids, attention_mask = pad_prompts([c[:-1] for _, _, c in fresh], pad)
        positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        sampler.prefill.into_rows(input_ids.to(device), positions.to(device), attention_mask.to(device), cache,
                                  torch.tensor([r for r, _, _ in fresh], device=device), end=slot)
    if extended:
        sampler.prefill.extend_rows(cache, [r for r, *_ in extended], [rows.first[r] for r, *_ in extended],
                                    [held for *_, held in extended], [c[held:-1] for _, _, c, held in extended],
                                    end=slot)
    joined = fresh + [(r, i, c) for r, i, c, _ in extended]
    index = torch.tensor([r for r, _, _ in joined], device=device)
    lengths = torch.tensor([c.numel() - 1 for _, _, c in joined], device=device)
    first = slot - lengths
    columns = torch.arange(buf.mask.shape[1], device=device)
    buf.mask[index] = ((columns >= first[:, None]) & (columns < slot)).to(buf.mask.dtype)
    buf.first_slot[index] = first
    buf.position[index, 0] = lengths
    buf.last_token[index] = torch.tensor([int(c[-1]) for _, _, c in joined], device=device)
    buf.done[index] = False
    for r, i, c in joined:
        rows.episode[r], rows.started[r], rows.room[r], rows.text[r] = i, generated, batch.room(i), ""
        rows.first[r] = slot - (c.numel() - 1)
    return [i for _, i, _ in joined], waiting, late
