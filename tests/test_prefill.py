"""grpo/inference/prefill.py: each distinct prompt is prefilled once, at rounded-up shapes too, and its cache rows
serve every reply that repeats it."""

import pytest
import torch
from test_decoding import QUESTIONS, greedy_replies_and_forwards, options, prompts, teacher_forced_log_probs

from grpo.inference.decoding import ReplySampler
from grpo.inference.kv_cache import slot_cache
from grpo.inference.prefill import Prefill, distinct_rows
from grpo.training.models import load_causal_lm, load_tokenizer


def allocated_cache(model, rows: int, slots: int):
    """A decode loop's cache, its tensors allocated (as its first decode step does)."""
    cache, text = slot_cache(model.config, slots, model.device), model.config.get_text_config()
    cache.early_initialization(rows, text.num_key_value_heads, text.hidden_size // text.num_attention_heads,
                               model.dtype, model.device)
    return cache


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
    return tok, model


def test_each_distinct_prompt_is_found_once_whatever_the_order():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 5, 6], [7, 8, 9], [0, 0, 9]])
    mask = (ids != 0).long()
    order = torch.tensor([3, 1, 5, 0, 4, 2])
    rows, copy_of = distinct_rows(ids[order], mask[order])
    assert sorted(rows.tolist()) == [0, 1, 2]  # the first row of each prompt
    assert torch.equal(ids[order][rows][copy_of], ids[order])
    same_mask_other_ids = distinct_rows(torch.tensor([[0, 5, 6], [0, 5, 7]]), torch.tensor([[0, 1, 1], [0, 1, 1]]))
    assert len(same_mask_other_ids[0]) == 2
    same_ids_other_mask = distinct_rows(torch.tensor([[0, 5, 6], [0, 5, 6]]), torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert len(same_ids_other_mask[0]) == 2


def test_prompts_rounded_up_to_a_bucket_give_the_same_replies_and_log_probs(tiny):
    """Three distinct prompts prefilled as four rows of 64 positions (left padding added, a filler row) decode the
    same greedy replies as at their own shape, and sampled ones carry the trainer's log-probs."""
    tok, model = tiny
    ids, mask = prompts(tok, QUESTIONS[:3])
    order = torch.tensor([2, 0, 1, 1, 0, 2, 2, 0])
    sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=False)
    alone = sampler.generate(ids[order], mask[order], **options(tok, model, do_sample=False))["sequences"]
    sampler.prefill = Prefill(model, sampler.cache_name, bucket=64, compile=False)
    rounded, forwards = greedy_replies_and_forwards(sampler, tok, model, ids[order], mask[order])
    assert ids.shape[1] < 64 and [shape for shape in forwards if shape[1] > 1] == [(4, 64)]
    assert torch.equal(rounded, alone)
    torch.manual_seed(0)
    out = sampler.generate(ids[order], mask[order], **options(tok, model))
    expected = teacher_forced_log_probs(model, out["sequences"], mask[order], tok.pad_token_id)
    real = out["sequences"][:, ids.shape[1]:] != tok.pad_token_id
    torch.testing.assert_close(out["log_probs"][real], expected[real], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled prefill runs on a GPU")
def test_on_a_gpu_the_compiled_prefill_writes_the_eager_ones_logits_and_cache(tiny_model_dir):
    """Prompts of two widths (the second compiled with dynamic sizes), each prefilled twice: the compiled prefill's
    logits and cache rows are the eager one's. In float32: in bfloat16 a compiled RMSNorm rounds once where the eager
    one rounds at each op, and the two drift apart by up to ~2% of a key's scale over the layers. (On the CPU the same
    check passes too, but its two compilations take ~50 s.)"""
    device = torch.device("cuda")
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, tok, dtype=torch.float32, device=device).eval()
    cache_name = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=False).cache_name
    eager, compiled = Prefill(model, cache_name, bucket=1, compile=False), Prefill(model, cache_name, bucket=64,
                                                                                 compile=True)
    order = torch.tensor([3, 1, 0, 2, 1, 3], device=device)
    for repeats in (1, 4):
        ids, mask = (t.to(device)[order] for t in prompts(tok, [" ".join([q] * repeats) for q in QUESTIONS]))
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        results = []
        for prefill in (eager, compiled):
            cache = allocated_cache(model, len(ids), 512)
            for _ in range(2):  # the compiled one's second call reuses its graph and cache
                logits = prefill(ids, positions, mask, cache)
            results.append((logits, [layer.keys[:, :, :ids.shape[1]] for layer in cache.layers]))
        (eager_logits, eager_keys), (compiled_logits, compiled_keys) = results
        real = mask.bool()[:, None, :, None].expand_as(eager_keys[0])
        torch.testing.assert_close(compiled_logits, eager_logits, atol=1e-4 * eager_logits.abs().max(), rtol=0)
        for eager_layer, compiled_layer in zip(eager_keys, compiled_keys):
            torch.testing.assert_close(compiled_layer[real], eager_layer[real],
                                       atol=1e-4 * eager_layer[real].abs().max(), rtol=0)


@pytest.mark.parametrize("added", [None, 1, 0])
def test_contexts_extended_in_their_own_rows_hold_the_keys_and_values_of_a_whole_prefill(tiny, added):
    """Rows that hold the first tokens of their contexts (from any slot) and get the rest appended (all of it, one
    token, none): each context's keys and values, moved to end at the given slot, are those of prefilling the whole
    context there, while only the added tokens run through the model and the other rows keep theirs."""
    tok, model = tiny
    cache_name = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=False).cache_name
    prefill = Prefill(model, cache_name, bucket=1, compile=False)
    ids, mask = prompts(tok, [q + " Then go on." * 3 for q in QUESTIONS])
    held, rows, end = [9, 30, 14, 21], [5, 0, 3, 6], 200
    contexts = [row[row != tok.pad_token_id] for row in ids]
    contexts = [c if added is None else c[:h + added] for c, h in zip(contexts, held)]

    def written(contexts, at):
        """Each context prefilled whole into its row, ending at ``at``."""
        cache = allocated_cache(model, 8, 256)
        padded = torch.nn.utils.rnn.pad_sequence(contexts, batch_first=True, padding_side="left")
        real = torch.nn.utils.rnn.pad_sequence([torch.ones_like(c) for c in contexts], batch_first=True,
                                               padding_side="left")
        prefill.into_rows(padded, (real.cumsum(-1) - 1).clamp_min(0), real, cache, torch.tensor(rows), end=at)
        return cache

    whole = written(contexts, end)
    extended = written([c[:h] for c, h in zip(contexts, held)], 120)  # the held tokens, elsewhere in the same rows
    before = [layer.keys[[1, 2, 4, 7]].clone() for layer in extended.layers]
    shapes = []
    hook = model.get_input_embeddings().register_forward_hook(lambda module, args, out: shapes.append(args[0].shape))
    prefill.extend_rows(extended, rows, [120 - h for h in held], held, [c[h:] for c, h in zip(contexts, held)], end)
    hook.remove()
    assert shapes == ([(4, max(len(c) - h for c, h in zip(contexts, held)))] if added != 0 else [])
    for whole_layer, layer, kept in zip(whole.layers, extended.layers, before, strict=True):
        for row, context in zip(rows, contexts):
            span = slice(end - len(context), end)
            torch.testing.assert_close(layer.keys[row, :, span], whole_layer.keys[row, :, span], atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values[row, :, span], whole_layer.values[row, :, span], atol=1e-5,
                                       rtol=0)
        assert torch.equal(layer.keys[[1, 2, 4, 7]], kept)
