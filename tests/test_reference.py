"""grpo/training/reference.py: rows the sampler hands the reference early get the scores they would get late."""

import dataclasses

import pytest
import torch

from conftest import SHORT_RUN, compose, train_in_process
from grpo.loop.logger import read_metrics
from grpo.tasks.paths import resolve_local_paths
from grpo.training.batch import to_training_batch
from grpo.training.logprobs import ReplyLogProbs, gathered_scores, queue_scores, queued_copy, score_replies
from grpo.training.models import load_causal_lm, load_tokenizer
from grpo.training.reference import ReferenceScores
from grpo.training.replies import Replies
from grpo.training.step import GRPOSettings

PAD, EOS = 0, 2


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}"])
    resolve_local_paths(cfg)
    model = load_causal_lm(cfg.model.name, load_tokenizer(cfg.model.name), dtype=torch.float32,
                           device=torch.device("cpu")).eval().requires_grad_(False)
    # micro-batches of 3 rows (training's, not a token budget of the reference's own): the early batch and the
    # step's batch are cut differently
    settings = dataclasses.replace(GRPOSettings.from_config(cfg), micro_batch_size=3, micro_batch_tokens=None,
                                   ref_micro_batch_tokens=None)
    return lambda: ReferenceScores(ReplyLogProbs(model), settings, pad_token_id=PAD)


def sampled(n: int, seed: int):
    """What the episode policy hands over: prompts of several lengths, episodes of several lengths, some ended by a
    stop token (the policy cut what an engine sampled after it)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 200, (int(torch.randint(2, 9, (), generator=g)),), generator=g) for _ in range(n)]
    replies = [torch.randint(3, 200, (10,), generator=g) for _ in range(n)]
    for i, reply in enumerate(replies):
        if i % 3 == 0:
            reply[4] = EOS
            replies[i] = reply[:5]
    return prompts, replies


def step_batch(prompts, replies):
    """The step's dense batch of these replies, as the collected ``Replies`` reach it."""
    return to_training_batch(Replies.from_sequences(
        prompts=prompts, replies=replies, log_probs=[torch.zeros(r.numel()) for r in replies],
        reward=torch.zeros(len(replies)), success=torch.zeros(len(replies)), row_index=torch.arange(len(replies)),
        user_prompts=[""] * len(replies)), PAD)


def test_rows_scored_early_get_the_scores_of_rows_scored_in_the_step(reference):
    """Two sampled batches scored early; the step keeps some rows of each, in another order, and one row nobody
    scored early: every row gets what scoring the step's batch itself gives it, and the count says which came early."""
    ref = reference()
    first, second = sampled(7, seed=0), sampled(5, seed=1)
    ref.score_early(*first)
    ref.score_early(*second)
    fresh = sampled(1, seed=2)
    keep = [(second, 4), (first, 0), (first, 5), (fresh, 0), (second, 1), (first, 3)]
    batch = step_batch([part[0][i] for part, i in keep], [part[1][i] for part, i in keep])
    scores, scored_early = ref(batch)
    assert scored_early == 5 and ref.early == []
    torch.testing.assert_close(scores, score_replies(batch, ref.scorer, ref.s), atol=1e-5, rtol=1e-5)
    assert bool((scores[~batch["reply_mask"]] == 0).all()) and bool((scores[batch["reply_mask"]] != 0).all())


def test_with_nothing_scored_early_the_step_scores_its_batch_as_before(reference):
    ref = reference()
    batch = step_batch(*sampled(6, seed=3))
    scores, scored_early = ref(batch)
    assert scored_early == 0
    assert torch.equal(scores, score_replies(batch, ref.scorer, ref.s))


@pytest.mark.parametrize("packed", [True, False])
def test_a_batch_of_empty_replies_scores_as_empty_rows(reference, packed):
    """A diverged model may sample a stop token first in every row: the batch handed over then has no reply token
    at all, and scoring it gives [S, 0] rather than failing the collection (early) or the step."""
    ref = reference()
    ref.s = dataclasses.replace(ref.s, packed_sequences=packed)
    ref.scorer.packed = packed
    prompts, _ = sampled(4, seed=6)
    sampled_pads = [torch.tensor([PAD, PAD]), torch.tensor([PAD]), torch.tensor([PAD, PAD, PAD]), torch.tensor([PAD])]
    replies = [reply[reply != PAD] for reply in sampled_pads]  # as engines hand them over and TorchRL on: no pads
    ref.score_early(prompts, replies)
    scores, scored_early = ref(step_batch(prompts, replies))
    assert scores.shape == (4, 0) and scored_early == 4


GPU_BUSY_CYCLES = 2_000_000_000  # ~1 s of an H100's clock


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's queue is what is under test")
def test_a_host_tensor_s_queued_copy_does_not_wait_for_the_gpu():
    """``queued_copy`` pins the tensor first: a copy from pageable memory larger than the driver's staging buffers
    waits for the stream's queued kernels (a reference micro-batch's inputs are a few MB)."""
    ids = torch.arange(4_000_000)  # 32 MB
    for copy, waits in ((queued_copy, False), (lambda t, device: t.to(device, non_blocking=True), True)):
        torch.cuda.synchronize()
        torch.cuda._sleep(GPU_BUSY_CYCLES)
        busy = torch.cuda.Event()
        busy.record()
        on_gpu = copy(ids, torch.device("cuda"))
        assert busy.query() is waits
        assert torch.equal(on_gpu.cpu(), ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's queue is what is under test")
def test_on_a_gpu_packed_rows_are_queued_without_waiting_for_the_gpu(tiny_model_dir):
    """With packed rows, scoring a batch neither syncs the host (torch's sync debug mode raises on one) nor waits for
    the kernels queued before it (micro-batch after micro-batch): the reference's forward is queued and the CPU goes
    on with the collection; the scores are those of scoring in the step."""
    tok = load_tokenizer(tiny_model_dir)
    model = load_causal_lm(tiny_model_dir, tok, dtype=torch.bfloat16, device=torch.device("cuda")).eval()
    scorer = ReplyLogProbs(model.requires_grad_(False), packed=True)
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}"])
    settings = dataclasses.replace(GRPOSettings.from_config(cfg), packed_sequences=True, micro_batch_size=3,
                                   micro_batch_tokens=None)
    batch = step_batch(*sampled(7, seed=5))
    expected = score_replies(batch, scorer, settings)  # also the first calls' one-off set-up (cuBLAS handles)
    torch.cuda.synchronize()
    torch.cuda._sleep(GPU_BUSY_CYCLES)  # the GPU still busy with what was queued before
    busy = torch.cuda.Event()
    busy.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        queued = queue_scores(batch, scorer, settings)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not busy.query(), "queuing the micro-batches waited for the GPU"
    scores = gathered_scores(queued, tuple(batch["reply_mask"].shape)) * batch["reply_mask"]
    torch.testing.assert_close(scores, expected)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_run_scores_its_sampled_batches_early_and_trains_the_same(tmp_path, dynamic):
    """grpo/grpo.py on the tiny task, with ref_model.score_early and without: with it every row of every step was
    scored while it was collected (with dynamic sampling too, whose steps keep some groups of several batches),
    and greedy eval batches were not handed over; the KL to the reference is the same either way (the first
    step's, before any update, ~0: the same weights)."""
    kl = {}
    for early in (True, False):
        run_dir = tmp_path / str(early)
        run = train_in_process(run_dir, [*SHORT_RUN, "train.total_steps=2", f"train.dynamic_sampling={dynamic}",
                                         f"ref_model.score_early={early}"])
        rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "kl_to_ref" in r]
        assert [r["reference_rows_scored_early"] for r in rows] == [1.0 if early else 0.0] * 2
        # the host's seconds handing the batches over, a part of generation's; none when nothing was handed over
        assert all(0 < r["reference_queue_s"] < r["generation_s"] if early else r["reference_queue_s"] == 0
                   for r in rows)
        assert run.trainer.grpo_step.ref.early == []  # the run's last eval (greedy) handed nothing over
        kl[early] = [r["kl_to_ref"] for r in rows]
    assert kl[True][0] < 1e-6
    assert kl[True] == pytest.approx(kl[False], rel=1e-5, abs=1e-9)


def test_a_token_budget_of_its_own_cuts_the_reference_s_forwards_by_tokens_alone(reference):
    """``ref_model.micro_batch_tokens``: the reference (no grad) takes as many rows a forward as the budget holds, not
    training's 3, and gives the scores training's cut gives."""
    by_rows = reference()
    batch = step_batch(*sampled(7, seed=4))
    shapes = []
    hook = by_rows.scorer.register_forward_hook(lambda module, args, out: shapes.append(tuple(args[0].shape)))
    try:
        expected, _ = by_rows(batch)
        forwards = {"training's": len(shapes)}
        for budget in (10_000, 1):
            shapes.clear()
            by_tokens = ReferenceScores(by_rows.scorer, dataclasses.replace(by_rows.s, ref_micro_batch_tokens=budget),
                                        pad_token_id=PAD)
            scores, _ = by_tokens(batch)
            forwards[budget] = len(shapes)
            torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    finally:
        hook.remove()
    assert forwards == {"training's": 3, 10_000: 1, 1: 7}  # 7 rows: 3 + 3 + 1; all at once; a row a forward
