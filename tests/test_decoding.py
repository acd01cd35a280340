"""grpo/inference/decoding.py: the decode loop samples what transformers would, with the trainer's log-probs."""

import pytest
import torch

from grpo.inference.decoding import (DECODE_COMPILE_OPTIONS, ReplySampler, compacted_size, filled_slot_bounds,
                                     graphed_rows, graphed_slots)
from grpo.training.models import load_causal_lm, load_tokenizer, stop_token_ids

QUESTIONS = ["What is 2 + 3?", "Tom has 12 apples and buys 30 more. How many apples does he have now?",
             "7 + 8 = ?", "What is 100 - 1?"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
    return tok, model, ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)


def prompts(tok, questions=QUESTIONS):
    chats = [[{"role": "user", "content": q}] for q in questions]
    enc = tok.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt", padding=True,
                                  padding_side="left", return_dict=True)
    return enc["input_ids"], enc["attention_mask"]


def options(tok, model, **overrides):
    return {"max_new_tokens": 24, "eos_token_id": stop_token_ids(tok, model.generation_config),
            "pad_token_id": tok.pad_token_id, "do_sample": True} | overrides


def teacher_forced_log_probs(model, sequences, prompt_mask, pad_id, temperature=1.0):
    """Each reply token's log-prob under softmax(logits / temperature), from one forward over prompt + reply
    (what the trainer computes)."""
    prompt_len = prompt_mask.shape[1]
    mask = torch.cat([prompt_mask, (sequences[:, prompt_len:] != pad_id).long()], 1)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp_min(0)).logits.float()
    log_probs = (logits[:, prompt_len - 1:-1] / temperature).log_softmax(-1)
    return log_probs.gather(-1, sequences[:, prompt_len:, None])[..., 0]


def greedy_replies_and_forwards(sampler, tok, model, ids, mask):
    """``sampler``'s greedy sequences for these prompts, and the ``input_ids`` shape of each forward it ran."""
    forwards = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        return sampler.generate(ids, mask, **options(tok, model, do_sample=False))["sequences"], forwards
    finally:
        hook.remove()


def test_greedy_replies_are_transformers_generate_replies(tiny):
    tok, model, sampler = tiny
    ids, mask = prompts(tok)
    ours = sampler.generate(ids, mask, **options(tok, model, do_sample=False))["sequences"]
    again = sampler.generate(ids, mask, **options(tok, model, do_sample=False))["sequences"]
    assert torch.equal(ours, again)  # the reused KV cache starts empty
    theirs = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=24,
                            eos_token_id=stop_token_ids(tok, model.generation_config), pad_token_id=tok.pad_token_id)
    width = max(ours.shape[1], theirs.shape[1])
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1]), value=tok.pad_token_id)  # noqa: E731
    assert torch.equal(pad(ours), pad(theirs))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_are_the_trainers_and_replies_stop_at_their_first_stop_token(tiny, temperature):
    tok, model, sampler = tiny
    ids, mask = prompts(tok)
    torch.manual_seed(0)
    out = sampler.generate(ids.repeat(4, 1), mask.repeat(4, 1), **options(tok, model, temperature=temperature))
    replies, log_probs = out["sequences"][:, ids.shape[1]:], out["log_probs"]
    stop = torch.tensor(stop_token_ids(tok, model.generation_config))
    ended = torch.isin(replies, stop)
    assert ended.any(dim=1).sum() > 0, "the test needs replies that finished before max_new_tokens"
    after_stop = ended.long().cumsum(1) - ended.long() > 0  # positions after a reply's first stop token
    assert (replies[after_stop] == tok.pad_token_id).all() and (log_probs[after_stop] == 0).all()
    expected = teacher_forced_log_probs(model, out["sequences"], mask.repeat(4, 1), tok.pad_token_id, temperature)
    torch.testing.assert_close(log_probs[~after_stop], expected[~after_stop], atol=1e-4, rtol=1e-4)


def test_a_prompt_the_batch_repeats_is_prefilled_once(tiny):
    """A GRPO group's replies share a prompt: the prefill runs on each distinct prompt once and its cache rows serve
    every reply that repeats it, in any order: greedy replies are each prompt's own, and sampled ones carry the
    trainer's log-probs. The distinct prompts' cache is not kept: only decode batches' are."""
    tok, model, sampler = tiny
    ids, mask = prompts(tok)
    order = torch.tensor([2, 0, 2, 1, 3, 2, 0, 1, 3, 3, 0, 1, 2, 0, 1, 3])
    kept = set(sampler._caches)
    greedy, forwards = greedy_replies_and_forwards(sampler, tok, model, ids[order], mask[order])
    prefills = [shape for shape in forwards if shape[1] > 1]  # the rest: one-token decode steps of the 16 rows
    assert prefills == [(len(ids), ids.shape[1])] and set(forwards) - set(prefills) == {(len(order), 1)}
    assert set(sampler._caches) - kept <= {len(order)}
    alone = sampler.generate(ids, mask, **options(tok, model, do_sample=False))["sequences"]
    assert torch.equal(greedy, alone[order])
    torch.manual_seed(0)
    out = sampler.generate(ids[order], mask[order], **options(tok, model))
    expected = teacher_forced_log_probs(model, out["sequences"], mask[order], tok.pad_token_id)
    real = out["sequences"][:, ids.shape[1]:] != tok.pad_token_id
    torch.testing.assert_close(out["log_probs"][real], expected[real], atol=1e-4, rtol=1e-4)


def test_kv_cache_is_sized_to_the_batch_and_only_grows(tiny):
    tok, model, _ = tiny
    sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
    ids, mask = prompts(tok)
    sampler.generate(ids, mask, **options(tok, model, max_new_tokens=8))
    slots, first = sampler.kv_cache(len(ids), 1)
    assert slots == -(-(ids.shape[1] + 8) // 64) * 64  # prompt + reply, rounded up to the bucket
    sampler.generate(ids[:, -5:], mask[:, -5:], **options(tok, model, max_new_tokens=8))
    assert sampler.kv_cache(len(ids), 1) == (slots, first)  # a shorter batch reuses it
    sampler.generate(ids, mask, **options(tok, model, max_new_tokens=slots))
    assert sampler.kv_cache(len(ids), 1)[0] > slots


def test_unknown_generate_options_are_refused(tiny):
    tok, model, sampler = tiny
    ids, mask = prompts(tok)
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampler.generate(ids, mask, **options(tok, model), repetition_penalty=1.2)


@pytest.mark.parametrize("batch", ["4 rows", "64 rows, compacted"])
def test_building_a_decode_step_leaves_the_random_stream_alone(tiny, batch):
    """A resumed run builds its decode step at another step than an uninterrupted one: building must
    not shift the samples that follow (it runs the step once, which samples); so must building the steps
    of a compacted batch in the middle of a reply."""
    tok, model, _ = tiny
    ids, mask, extra = (*prompts(tok), {}) if batch == "4 rows" else spread_out_replies(tok, model)
    fresh = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
    torch.manual_seed(1)
    first = fresh.generate(ids, mask, **options(tok, model, **extra))["sequences"]  # builds, then samples
    assert len(fresh.batch_sizes) == 1 if batch == "4 rows" else len(fresh.batch_sizes) >= 2  # built mid-reply
    torch.manual_seed(1)
    again = fresh.generate(ids, mask, **options(tok, model, **extra))["sequences"]  # already built
    assert torch.equal(first, again)


def spread_out_replies(tok, model):
    """64 prompts whose replies end at lengths from 1 to ~20 tokens (cap 48): the tiny model rarely writes its eos,
    so the token "The", which it writes early in some replies and late in others, stops them too."""
    ids, mask = prompts(tok, [f"What is {a} + {b}?" for a in range(8) for b in range(8)])
    stop_ids = stop_token_ids(tok, model.generation_config) + tok.convert_tokens_to_ids(["The"])
    return ids, mask, {"eos_token_id": stop_ids, "max_new_tokens": 48}


def test_rows_that_ended_leave_the_batch_and_the_replies_stay_the_same(tiny):
    """Greedy replies of 64 prompts: at each stop check the rows still decoding move to the smallest halving of
    the batch that holds them (64 -> 32 -> 16 here), and every reply is token for token what the whole batch
    writes, with the same log-probs; also when a smaller batch's cache, grown by an earlier call, has more slots."""
    tok, model, _ = tiny
    ids, mask, extra = spread_out_replies(tok, model)
    outs = {}
    for compact in (False, True):
        sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=compact)
        if compact:
            sampler.generate(ids[:32], mask[:32], **options(tok, model, do_sample=False, max_new_tokens=160))
            assert sampler.kv_cache(32, 1)[0] > sampler.kv_cache(64, ids.shape[1] + 48)[0]
        outs[compact] = sampler.generate(ids, mask, **options(tok, model, do_sample=False, **extra))
        assert sampler.batch_sizes == ([64, 32, 16] if compact else [64])
    assert torch.equal(outs[True]["sequences"], outs[False]["sequences"])
    torch.testing.assert_close(outs[True]["log_probs"], outs[False]["log_probs"], atol=1e-5, rtol=1e-5)
    lengths = (outs[True]["sequences"][:, ids.shape[1]:] != tok.pad_token_id).sum(1)
    assert lengths.min() < 8 and lengths.max() > 16  # rows left the batch at different checks


def test_compacted_replies_are_sampled_with_the_trainers_log_probs(tiny):
    """Sampled replies of a batch that compacted: each reply ends at its first stop token, followed by pads,
    and its log-probs are the teacher-forced ones: no row was given another row's cache or tokens. Also on the
    sampler's second call, whose buffers hold the first call's replies where rows left the batch early."""
    tok, model, _ = tiny
    ids, mask, extra = spread_out_replies(tok, model)
    sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
    for seed in (0, 1):
        torch.manual_seed(seed)
        out = sampler.generate(ids, mask, **options(tok, model, **extra))
        assert sampler.batch_sizes[0] == 64 and len(sampler.batch_sizes) > 1
        replies, log_probs = out["sequences"][:, ids.shape[1]:], out["log_probs"]
        ended = torch.isin(replies, torch.tensor(extra["eos_token_id"]))
        after_stop = ended.long().cumsum(1) - ended.long() > 0
        assert (replies[after_stop] == tok.pad_token_id).all() and (log_probs[after_stop] == 0).all()
        expected = teacher_forced_log_probs(model, out["sequences"], mask, tok.pad_token_id)
        torch.testing.assert_close(log_probs[~after_stop], expected[~after_stop], atol=1e-4, rtol=1e-4)


def test_filled_slot_bounds_are_the_attention_masks_slots_also_after_compaction(tiny):
    """The spans the GPU's decode attention reads (``filled_slot_bounds``: each reply and KV head's filled slots,
    in the cache read flat) are exactly the slots the attention mask admits at a step, for every decode batch a
    compacting call built: the whole batch's and its halvings, whose rows came from other rows."""
    tok, model, _ = tiny
    _, _, extra = spread_out_replies(tok, model)
    ids, mask = prompts(tok, [f"What is {a} + {b}?" + " Be brief." * (b % 4) for a in range(8) for b in range(8)])
    assert not mask.all()  # prompts of different lengths: left padding
    sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
    sampler.generate(ids, mask, **options(tok, model, do_sample=False, **extra))
    q_heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    assert len(sampler._steps) >= 2 and q_heads > kv_heads > 1
    for buf, _ in sampler._steps.values():
        buf.mask.index_fill_(1, buf.slot, 1)  # as a step does before its forward
        bounds = filled_slot_bounds(buf, kv_heads)
        starts, lengths = bounds["filled_kv_starts"].long(), bounds["filled_kv_lengths"].long()
        batch, slots = buf.mask.shape
        read = torch.zeros(batch * kv_heads * slots, dtype=torch.bool)
        for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
            read[start:start + length] = True
        assert torch.equal(read, buf.mask.bool()[:, None].expand(batch, kv_heads, slots).flatten())
        assert bounds["filled_kv_starts"].dtype == bounds["filled_kv_lengths"].dtype == torch.int32


def on_the_gpu_with_spread_out_replies(tiny_model_dir, dtype):
    """The tiny model on the GPU in ``dtype``, and ``spread_out_replies``' prompts there."""
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, tok, dtype=dtype, device=torch.device("cuda")).eval()
    ids, mask, extra = spread_out_replies(tok, model)
    return tok, model, ids.cuda(), mask.cuda(), extra


def log_prob_gap(model, tok, out, prompt_mask) -> float:
    """Mean |sampler's log-prob - teacher-forced log-prob| over the reply tokens of a generate call's ``out``."""
    expected = teacher_forced_log_probs(model, out["sequences"].cuda(), prompt_mask, tok.pad_token_id)
    real = out["sequences"][:, prompt_mask.shape[1]:].cuda() != tok.pad_token_id
    return float((out["log_probs"].cuda() - expected)[real].abs().mean())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the filled-slot kernel needs a GPU")
def test_on_a_gpu_decoding_that_reads_filled_slots_only_samples_with_the_trainers_log_probs(tiny_model_dir):
    """bf16 on a GPU: the filled-slot attention's replies carry the teacher-forced log-probs as closely as the
    dense attention's, sampled and greedy (greedy replies may part where bf16 flips a near-tie); prompts that are
    not left-padded are refused in one line."""
    tok, model, ids, mask, extra = on_the_gpu_with_spread_out_replies(tiny_model_dir, torch.bfloat16)
    gaps = {}
    for filled in (True, False):
        sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
        assert sampler.kv_heads is not None  # a GPU in half precision reads the filled slots
        if not filled:
            sampler.kv_heads = None  # the dense attention, every slot under the mask, to compare with
        for do_sample in (True, False):
            torch.manual_seed(0)
            out = sampler.generate(ids, mask, **options(tok, model, do_sample=do_sample, **extra))
            gaps[filled, do_sample] = log_prob_gap(model, tok, out, mask)
    for do_sample in (True, False):
        assert gaps[True, do_sample] < 0.02 and gaps[True, do_sample] < 2 * gaps[False, do_sample] + 1e-3, gaps
    ids, mask = prompts(tok)  # of different lengths
    assert not mask.all()
    right_padded = mask.flip(-1)
    with pytest.raises(ValueError, match="not left-padded.*read as one span a reply"):
        ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True).generate(ids.cuda(), right_padded.cuda(),
                                                                                        **options(tok, model))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sampler's Triton kernels need a GPU")
def test_on_a_gpu_the_sampler_kernels_in_the_captured_step_give_the_same_greedy_replies_and_the_trainers_log_probs(
        tiny_model_dir):
    """float32 on a GPU, the decode step compiled and captured as a CUDA graph: with the sampler's kernels (the
    default) the greedy replies are the compiled sampler's, token for token, and sampled replies carry the
    teacher-forced log-probs."""
    tok, model, ids, mask, extra = on_the_gpu_with_spread_out_replies(tiny_model_dir, torch.float32)
    greedy = {}
    for kernel in (False, True):
        sampler = ReplySampler(model, compile=True, cache_bucket=64, compact_rows=False)
        sampler.sampler_kernel = kernel
        greedy[kernel] = sampler.generate(ids, mask, **options(tok, model, do_sample=False, **extra))["sequences"]
    assert torch.equal(greedy[True], greedy[False])
    torch.manual_seed(0)
    assert log_prob_gap(model, tok, sampler.generate(ids, mask, **options(tok, model, **extra)), mask) < 1e-4


def test_the_decode_steps_compile_options_are_ones_this_torch_takes_and_keep_its_numbers():
    """The options the decode step is compiled with (programmatic dependent launch, combo kernels) name inductor
    settings this torch has (an unknown one is refused when compiling), and two independent pointwise results (the
    rotary embedding of q and of k, which combo kernels launch as one) come out as eagerly."""
    def rotate(q, k, cos, sin):
        return q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin

    q, k, cos, sin = torch.randn(4, 7, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    compiled = torch.compile(rotate, fullgraph=True, dynamic=False, options=DECODE_COMPILE_OPTIONS)
    for got, expected in zip(compiled(q, k, cos, sin), rotate(q, k, cos, sin)):
        torch.testing.assert_close(got, expected)
    with pytest.raises(RuntimeError, match="Unexpected optimization option"):
        torch.compile(rotate, options={**DECODE_COMPILE_OPTIONS, "triton.no_such_setting": True})


@pytest.mark.parametrize("batch, active, size", [(128, 65, None), (128, 64, 64), (128, 20, 32), (128, 3, 16),
                                                 (64, 1, 16), (16, 1, None), (319, 30, 39)])
def test_a_batch_halves_to_hold_the_rows_still_decoding_and_never_below_16(batch, active, size):
    assert compacted_size(batch, active) == size


def test_an_inference_copy_runs_fused_projections_that_weight_pushes_reach(tiny, tiny_model_dir):
    """A frozen model's q/k/v and gate/up run as one GEMM each: same logits and replies, same state-dict
    names, and new weights copied into its parameters (a push) reach the fused GEMMs."""
    tok, trained, trained_sampler = tiny
    copy = load_causal_lm(tiny_model_dir, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
    names = list(copy.state_dict())
    copy.requires_grad_(False)
    sampler = ReplySampler(copy, compile=False, cache_bucket=64, compact_rows=True)
    assert isinstance(trained.model.layers[0].self_attn.k_proj, torch.nn.Linear)  # a trained model is left alone
    assert not isinstance(copy.model.layers[0].self_attn.k_proj, torch.nn.Linear)
    assert list(copy.state_dict()) == names
    ids, mask = prompts(tok)
    greedy = options(tok, copy, do_sample=False)
    assert torch.equal(sampler.generate(ids, mask, **greedy)["sequences"],
                       trained_sampler.generate(ids, mask, **greedy)["sequences"])
    g = torch.Generator().manual_seed(0)
    pushed = {name: tensor + 0.01 * torch.randn(tensor.shape, generator=g) for name, tensor in trained.state_dict().items()}
    with torch.no_grad():
        for name, tensor in copy.state_dict().items():
            tensor.copy_(pushed[name])
        moved = load_causal_lm(tiny_model_dir, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
        moved.load_state_dict(pushed)
        torch.testing.assert_close(copy(ids, attention_mask=mask).logits, moved(ids, attention_mask=mask).logits,
                                   atol=1e-5, rtol=1e-5)


def test_a_policy_that_trains_samples_through_fused_copies_that_its_updates_reach(tiny_model_dir):
    """The policy an engine shares (``fuse_shared``): while it samples, its q/k/v and gate/up run as one GEMM each,
    from copies refreshed at each call, so an update in between reaches them; it samples what an unfused sampler of
    the same weights samples; outside sampling the projections are its own linears again, which gradients reach."""
    tok = load_tokenizer(tiny_model_dir)
    load = lambda: load_causal_lm(tiny_model_dir, tok, dtype=torch.float32, device=torch.device("cpu")).eval()  # noqa: E731
    policy, twin = load(), load()
    fused = ReplySampler(policy, compile=False, cache_bucket=64, compact_rows=False)
    plain = ReplySampler(twin, compile=False, cache_bucket=64, compact_rows=False, fuse_shared=False)
    q_proj = policy.model.layers[0].self_attn.q_proj
    seen = []
    sample = fused.sample  # what the decode loop runs on, seen from inside it
    fused.sample = lambda *a, **k: seen.append(type(policy.model.layers[0].self_attn.q_proj).__name__) or sample(*a, **k)
    ids, mask = prompts(tok)
    outputs = []
    for update in range(2):
        if update:  # an optimiser step on both, between two calls
            g = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for (_, a), (_, b) in zip(policy.named_parameters(), twin.named_parameters(), strict=True):
                    noise = 0.05 * torch.randn(a.shape, generator=g)
                    a.add_(noise)
                    b.add_(noise)
        runs = []
        for sampler in (fused, plain):
            torch.manual_seed(0)
            runs.append(sampler.generate(ids, mask, **options(tok, policy)))
        torch.testing.assert_close(runs[0]["sequences"], runs[1]["sequences"], rtol=0, atol=0)
        torch.testing.assert_close(runs[0]["log_probs"], runs[1]["log_probs"], atol=1e-5, rtol=1e-5)
        outputs.append(runs[0]["log_probs"])
    assert seen == ["ProjectionOfShared"] * 2 and policy.model.layers[0].self_attn.q_proj is q_proj
    assert not torch.allclose(outputs[0], outputs[1])  # the update reached the fused copies
    policy(ids, attention_mask=mask).logits.sum().backward()
    assert q_proj.weight.grad is not None and q_proj.weight.grad.abs().sum() > 0


def test_graphed_shapes_are_powers_of_two_so_later_turns_reuse_the_compaction_sizes_and_few_cache_lengths():
    assert [graphed_rows(rows) for rows in (1, 16, 17, 33, 64, 65, 128)] == [16, 16, 32, 64, 64, 128, 128]
    assert {compacted_size(128, active) for active in range(1, 65)} <= {graphed_rows(r) for r in range(1, 129)}
    assert [graphed_slots(length, 128) for length in (1, 128, 129, 300, 712, 1324, 2048)] == [
        128, 128, 256, 512, 1024, 2048, 2048]
    # a 3-turn episode's contexts up to a 2,048-token cap need 4 cache lengths, not 16
    assert len({graphed_slots(length, 128) for length in range(200, 2049)}) == 4
