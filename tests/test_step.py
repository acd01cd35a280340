"""The GRPO step (grpo.training.step): the loss and the group advantage against hand computations and against
TorchRL's own GRPOLoss and MCAdvantage, on small real batches collected by TorchRL's collector."""

import copy
import dataclasses
import math

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors.llm import LLMCollector
from torchrl.modules.llm import TransformersWrapper
from torchrl.objectives.llm import GRPOLoss, MCAdvantage

from conftest import compose, reply_log_probs
from grpo.inference.decoding import ReplySampler
from grpo.inference.engine import make_transformers_policy
from grpo.inference.generation import EngineSettings, generate_kwargs
from grpo.tasks.paths import resolve_local_paths
from grpo.tasks.envs import make_env
from grpo.tasks.settings import TaskSettings
from grpo.training.advantages import group_advantages, overlong_penalty
from grpo.training.batch import micro_batches, to_training_batch, trim_padding
from grpo.training.logprobs import ReplyLogProbs, micro_on_device, score_replies
from grpo.training.models import load_policy_model, load_tokenizer, stop_token_ids, torch_dtype
from grpo.training.replies import Replies
from grpo.training.settings import ModelSettings, OptimizerSettings
from grpo.training.step import GRPOSettings, GRPOStep, LossTotals, grpo_terms, per_sample_kl_to_ref, weighted_loss
from grpo.training.trainer import make_optimizer, make_scheduler


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tiny_data_dir):
    torch.manual_seed(0)
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}", "env.repeats=4",
                                "env.num_envs=8", "train.dialog_turns_per_batch=8", "train.optim_batch_size=8",
                                "inference_model.max_new_tokens=24"])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    model = load_policy_model(ModelSettings.from_config(cfg), tok, torch.device("cpu"))
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=4, num_envs=8)
    stop_ids = stop_token_ids(tok, model.generation_config)
    settings = EngineSettings.from_config(cfg)
    policy = make_transformers_policy(ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True), tok,
                                      gen_kwargs=generate_kwargs(settings, tok, greedy=False, max_new_tokens=24,
                                                                 stop_ids=stop_ids))
    rollouts = next(iter(LLMCollector(env, policy=policy, dialog_turns_per_batch=8, total_dialog_turns=-1))).reshape(-1)
    batch = to_training_batch(Replies.from_collector(rollouts), tok.pad_token_id)
    batch["advantage"] = group_advantages(batch["reward"], batch["group_id"])
    assert len(set(batch["reply_length"].tolist())) > 1, "the test needs replies of different lengths"
    return cfg, tok, model, rollouts, batch


def terms_of(cfg, model, batch, forward=None) -> dict:
    return grpo_terms(forward or ReplyLogProbs(model), batch, GRPOSettings.from_config(cfg))


def unpadded_reply_log_probs(model, sample) -> torch.Tensor:
    """log pi(token_t | tokens_<t) of one sample's reply tokens, straight from the HF model, no padding."""
    full = sample["tokens", "full"]
    n = sample["tokens", "response"].shape[-1]
    logits = model(full[None]).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, full[1:, None]).squeeze(-1)
    return lp[-n:]


def test_dense_batch_keeps_the_samplers_log_probs_and_the_model_agrees(setup):
    """Behaviour log-probs are the sampler's (first reply token included: TorchRL zeroes it), and the
    padded reply-only forward of the loss gives the same numbers as an unpadded forward."""
    _, _, model, rollouts, batch = setup
    with torch.no_grad():
        dense_lp = reply_log_probs(model, batch)
        for i, sample in enumerate(rollouts.unbind(0)):
            n = sample["tokens", "response"].shape[-1]
            reference = unpadded_reply_log_probs(model, sample)
            torch.testing.assert_close(batch["behaviour_log_probs"][i, :n], reference, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(dense_lp[i, :n], reference, atol=1e-4, rtol=1e-4)
            assert batch["reply_mask"][i].sum() == n
            assert torch.equal(batch["input_ids"][i][batch["attention_mask"][i]], sample["tokens", "full"])


def test_trim_padding_leaves_log_probs_unchanged(setup):
    _, _, model, _, batch = setup
    shorter = (batch["reply_length"] < batch["reply_length"].max()).nonzero().flatten()
    part = batch[shorter]
    trimmed = trim_padding(part)
    assert trimmed["reply_mask"].shape[1] == int(part["reply_length"].max()) < part["reply_mask"].shape[1]
    with torch.no_grad():
        full = reply_log_probs(model, part)
        short = reply_log_probs(model, trimmed)
    width = trimmed["reply_mask"].shape[1]
    torch.testing.assert_close(short * trimmed["reply_mask"], full[:, :width] * part["reply_mask"][:, :width],
                               atol=1e-5, rtol=1e-5)


def test_group_advantage_equals_torchrl_mcadvantage(setup):
    _, _, _, rollouts, batch = setup
    rewards = torch.tensor([1.0, 0.0, 0.1, 1.0, 0.0, 0.0, 0.0, 1.1])
    rollouts = rollouts.clone()
    rollouts.set(("next", "reward"), rewards.view(8, 1, 1))
    oracle = MCAdvantage(grpo_size=4)._inv_call(rollouts)
    expected = {(s["query"], float(s["next", "reward"].flatten()[0])): float(s["advantage"].flatten()[0])
                for s in oracle.unbind(0)}
    ours = group_advantages(rewards, batch["group_id"])
    assert len(set(batch["group_id"].tolist())) == 2
    for sample, r, a in zip(rollouts.unbind(0), rewards.tolist(), ours.tolist()):
        assert a == pytest.approx(expected[(sample["query"], r)], abs=1e-5)


def test_group_advantage_by_hand_any_order():
    group_ids = torch.tensor([3, 7, 3, 7, 3, 7])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 1.0])
    got = group_advantages(rewards, group_ids)
    for g in (3, 7):
        r = rewards[group_ids == g]
        mean, std = r.mean(), math.sqrt(((r - r.mean()) ** 2).sum() / (len(r) - 1))
        torch.testing.assert_close(got[group_ids == g], (r - mean) / std)
    # all-equal rewards carry no signal; a lone reply has no baseline
    assert group_advantages(torch.ones(4), torch.zeros(4)).abs().max() == 0
    assert group_advantages(torch.tensor([2.0]), torch.tensor([0])).item() == 0


def _perturbed_old_log_probs(batch, seed=1, scale=1.2):
    gen = torch.Generator().manual_seed(seed)
    noise = (torch.rand(batch["behaviour_log_probs"].shape, generator=gen) - 0.5) * scale
    return batch["behaviour_log_probs"] - noise * batch["reply_mask"]


def test_loss_value_and_gradient_equal_torchrl_grpoloss(setup):
    """Same estimator as TorchRL's GRPOLoss (token_mean, asymmetric clip, masked entropy) on the same data."""
    cfg, tok, model, rollouts, batch = setup
    batch = batch.clone()
    batch["behaviour_log_probs"] = _perturbed_old_log_probs(batch)
    batch["advantage"] = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5, 2.0, -1.5])
    cfg = cfg.copy()
    cfg.train.use_kl_to_ref = False

    # TorchRL: per-sample tensordicts with ("log_probs","full") over prompt + reply
    rollouts = rollouts.clone()
    for i, sample in enumerate(rollouts.unbind(0)):
        n, p = int(batch["reply_length"][i]), sample["tokens", "prompt"].shape[-1]
        sample.set(("log_probs", "full"), torch.cat([torch.zeros(p), batch["behaviour_log_probs"][i, :n]]))
    rollouts.set("advantage", batch["advantage"].view(8, 1, 1))
    torchrl_loss = GRPOLoss(
        TransformersWrapper(model, tokenizer=tok, input_mode="tokens", generate=False, return_log_probs=True,
                            pad_output=False),
        clip_epsilon=(cfg.train.clip_epsilon_low, cfg.train.clip_epsilon_high), entropy_bonus=True,
        entropy_coeff=1.0, aggregation="token_mean", masking_strategy="sft")
    torchrl_loss.set_keys(sample_log_prob=("log_probs", "full"))
    params = [p for p in model.parameters() if p.requires_grad]

    expected = torchrl_loss(rollouts)
    expected_grad = torch.autograd.grad(expected.loss_objective, params)
    ours = terms_of(cfg, model, batch)
    grad = torch.autograd.grad(ours["objective"], params)

    assert float(ours["objective"]) == pytest.approx(float(expected.loss_objective), rel=1e-4, abs=1e-6)
    assert float(ours["ess"]) == pytest.approx(float(expected.ESS), rel=1e-5)
    assert -float(ours["entropy"]) == pytest.approx(float(expected.loss_entropy), rel=1e-4)
    for g, e in zip(grad, expected_grad):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-3)
    assert float(ours["clip_fraction"]) > 0 and 0 < float(ours["ess"]) < 1


ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5, 2.0, -1.5])


def known_ratios(setup, old_log_probs=_perturbed_old_log_probs):
    """The setup's batch with known advantages and sampler log-probs, and the model's own log-probs."""
    cfg, _, model, _, batch = setup
    batch = batch.clone()
    with torch.no_grad():
        cur = reply_log_probs(model, batch)
    batch["behaviour_log_probs"] = old_log_probs(batch)
    batch["advantage"] = ADVANTAGES
    return cfg, model, batch, cur


def hand_gain(ratio, advantage, cfg):
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), written out."""
    return torch.minimum(ratio * advantage,
                         ratio.clamp(1 - cfg.train.clip_epsilon_low, 1 + cfg.train.clip_epsilon_high) * advantage)


def test_clipped_loss_matches_hand_computation(setup):
    """Known importance ratios and advantages: loss = -mean_tokens min(r A, clip(r, 1-el, 1+eh) A)."""
    cfg, model, batch, cur = known_ratios(setup)
    eps_low, eps_high = cfg.train.clip_epsilon_low, cfg.train.clip_epsilon_high
    gains, clipped, count = [], 0, 0
    for i in range(8):
        n = int(batch["reply_length"][i])
        ratio = (cur[i, :n] - batch["behaviour_log_probs"][i, :n]).exp()
        gains.append(hand_gain(ratio, ADVANTAGES[i], cfg))
        clipped += int(((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).sum())
        count += n
    out = terms_of(cfg, model, batch)
    assert float(out["objective"]) == pytest.approx(float(-torch.cat(gains).sum() / count), rel=1e-4, abs=1e-5)
    assert float(out["clip_fraction"]) == pytest.approx(clipped / count, abs=1e-6)
    assert 0 < float(out["ess"]) < 1


def test_prompt_mean_weights_each_sample_equally(setup):
    cfg, _, model, _, batch = setup
    batch = batch.clone()
    cfg = cfg.copy()
    cfg.train.aggregation = "prompt_mean"
    batch["advantage"] = torch.linspace(-1, 1, 8)
    with torch.no_grad():
        cur = reply_log_probs(model, batch)
        out = terms_of(cfg, model, batch)
    # old == sampler log-probs, so each ratio is ~1 and each sample's mean gain is ~its advantage
    ratio = (cur - batch["behaviour_log_probs"]).exp() * batch["reply_mask"]
    per_sample = (ratio * batch["advantage"][:, None]).sum(-1) / batch["reply_length"]
    assert float(out["objective"]) == pytest.approx(float(-per_sample.mean()), abs=1e-5)


def test_kl_to_ref_penalty_is_masked_k3(setup):
    cfg, _, model, _, batch = setup
    batch = batch.clone()
    cfg = cfg.copy()
    cfg.train.kl_to_ref_coeff = 0.5
    with torch.no_grad():
        cur = reply_log_probs(model, batch)
    ref = cur + 0.3 * torch.randn(cur.shape, generator=torch.Generator().manual_seed(2))
    batch["ref_log_probs"] = ref * batch["reply_mask"]
    batch["advantage"] = torch.zeros(8)
    out = terms_of(cfg, model, batch)
    d = (ref - cur)[batch["reply_mask"]]
    expected_kl = (d.expm1() - d).mean()
    assert float(out["kl_to_ref"]) == pytest.approx(float(expected_kl), rel=1e-4)
    # the loss carries it at its weight, next to the objective (the other weights are 0 here)
    settings = GRPOSettings.from_config(cfg)
    assert float(weighted_loss(out, settings)) == pytest.approx(float(out["objective"]) + 0.5 * float(expected_kl),
                                                                rel=1e-4)
    # in the reward instead: no loss term
    assert "kl_to_ref" not in grpo_terms(ReplyLogProbs(model), batch, dataclasses.replace(settings, kl_coef_in_loss=False))


def test_kl_in_reward_lowers_reward_by_coeff_times_kl():
    replies = Replies.from_sequences(prompts=[[0, 1, 2], [0, 1]], replies=[[3, 4], [2]],
                                     log_probs=[[-1.0, -2.0], [-0.5]], reward=[1.0, 1.0], success=[True, True],
                                     row_index=[0, 1], user_prompts=["a", "b"])
    batch = to_training_batch(replies, pad_token_id=0)
    batch["ref_log_probs"] = torch.tensor([[-1.5, -2.0], [-0.1, 0.0]])

    def k3(beh, ref):
        d = torch.tensor(ref) - torch.tensor(beh)
        return float((d.expm1() - d).mean())

    kl = per_sample_kl_to_ref(batch).tolist()
    assert kl[0] == pytest.approx(k3([-1.0, -2.0], [-1.5, -2.0]), abs=1e-6)
    assert kl[1] == pytest.approx(k3([-0.5], [-0.1]), abs=1e-6)


def optimizer_settings(cfg) -> OptimizerSettings:
    """The config's optimiser, its schedule 100 optimiser steps long."""
    return dataclasses.replace(OptimizerSettings.from_config(cfg), total_optim_steps=100)


def make_step(cfg, model, ref_model=None, **settings) -> GRPOStep:
    optim = optimizer_settings(cfg)
    optimizer = make_optimizer(optim, model)
    settings = dataclasses.replace(GRPOSettings.from_config(cfg), **settings)
    return GRPOStep(settings, policy=ReplyLogProbs(model, packed=settings.packed_sequences),
                    optimizer=optimizer, scheduler=make_scheduler(optim, optimizer), ref_model=ref_model,
                    pad_token_id=0)


def test_optimize_steps_once_per_minibatch_and_starts_on_policy(setup):
    """epochs x S / optim_batch_size optimiser steps, each over accumulated micro-batches; before the
    first update the trainer scores the sampler's tokens as the sampler did (same weights)."""
    cfg, tok, model, rollouts, batch = setup
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        step = make_step(cfg, model, epochs=2, micro_batch_size=2, optim_batch_size=4)
        metrics = step.optimize(batch.clone())
        assert metrics["optim_steps"] == 2 * 8 // 4
        assert metrics["mismatch/kl"] < 1e-3
        assert any((p != before[n]).any() for n, p in model.named_parameters())
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(before[n])


@pytest.mark.parametrize("variant, aggregation", [("grpo", "token_mean"), ("grpo", "prompt_mean"),
                                                ("dr_grpo", "token_mean"), ("gspo", "token_mean")])
def test_micro_batches_add_up_to_one_pass_over_the_minibatch(setup, variant, aggregation):
    """However a minibatch is cut (rows sorted by length, at most 3 rows and a token budget), its
    micro-batches' terms, divided by the minibatch's totals, add up to the terms and the gradient of
    one dense pass over the whole minibatch."""
    cfg, _, model, _, batch = setup
    batch = batch.clone()
    batch["advantage"] = torch.linspace(-1.0, 1.0, batch.shape[0])
    batch["behaviour_log_probs"] = _perturbed_old_log_probs(batch)  # some ratios clipped
    batch["ref_log_probs"] = _perturbed_old_log_probs(batch, seed=5, scale=0.4)
    settings = dataclasses.replace(GRPOSettings.from_config(cfg), loss_variant=variant, aggregation=aggregation,
                                   kl_to_inference_coeff=0.1, entropy_coeff=0.01)

    def summed_terms(parts, totals):
        model.zero_grad(set_to_none=True)
        summed = {}
        for part in parts:
            out = grpo_terms(ReplyLogProbs(model), part, settings, totals)
            weighted_loss(out, settings).backward()
            summed = {k: summed.get(k, 0.0) + v.detach() for k, v in out.items()}
        return summed, [p.grad.clone() for p in model.parameters()]

    whole, whole_grads = summed_terms([trim_padding(batch)], None)
    budget = 3 * int((batch["prompt_length"] + batch["reply_length"]).max()) - 1  # never 3 of the longest
    cuts = list(micro_batches(batch, 3, budget))
    assert len(cuts) >= 3
    assert sorted(torch.cat([rows for rows, _ in cuts]).tolist()) == list(range(batch.shape[0]))
    assert all(len(rows) == 1 or part["input_ids"].numel() <= budget for rows, part in cuts)
    split, split_grads = summed_terms([part for _, part in cuts], LossTotals.of(batch))
    assert set(split) == set(whole) and "kl_to_ref" in whole
    for key in whole:
        if key not in ("ess", "max_abs_logprob_gap"):  # not sums: the micro-batch's own (ess weighted by its tokens)
            torch.testing.assert_close(split[key], whole[key], atol=1e-6, rtol=1e-4)
    assert variant == "gspo" or float(whole["clip_fraction"]) > 0  # gspo's per-reply means stay inside the clip
    for g_split, g_whole in zip(split_grads, whole_grads):
        torch.testing.assert_close(g_split, g_whole, atol=1e-6, rtol=1e-4)
    model.zero_grad(set_to_none=True)


def test_micro_batches_of_short_replies_hold_more_rows():
    """A token budget cuts by padded size (rows x trimmed width), rows sorted by length: a budget of
    two long rows holds four short ones, and each micro-batch is trimmed to its own width."""
    prompt_len, reply_len = torch.tensor([4, 4, 3, 4, 4, 4]), torch.tensor([20, 2, 2, 20, 3, 2])
    cols = torch.arange(24)
    attention = (cols >= 4 - prompt_len[:, None]) & (cols < 4 + reply_len[:, None])
    batch = TensorDict({"input_ids": torch.arange(6 * 24).view(6, 24), "attention_mask": attention,
                        "reply_mask": attention[:, 4:], "prompt_length": prompt_len, "reply_length": reply_len},
                       batch_size=[6])
    cuts = [(rows.tolist(), part) for rows, part in micro_batches(batch, 6, 2 * 24)]
    assert [rows for rows, _ in cuts] == [[2, 1, 5, 4], [0, 3]]
    assert cuts[0][1]["input_ids"].shape == (4, 7) and cuts[1][1]["input_ids"].shape == (2, 24)
    assert [rows.tolist() for rows, _ in micro_batches(batch, 3, None)] == [[2, 1, 5], [4, 0, 3]]
    # packed rows count their real tokens (5, 6, 6, 7, 24, 24): five fit in 48
    assert [rows.tolist() for rows, _ in micro_batches(batch, 6, 2 * 24, packed=True)] == [[2, 1, 5, 4, 0], [3]]


def test_packed_step_trains_as_the_dense_step(setup):
    """train.packed_sequences changes how the rows reach the model, not the loss: the same metrics and the same
    weights after its optimiser steps as with padded rows, the reference's log-probs included."""
    cfg, _, model, _, batch = setup
    batch = batch.clone()
    batch["advantage"] = torch.linspace(-1.0, 1.0, batch.shape[0])
    outcomes = []
    for packed in (False, True):
        policy = copy.deepcopy(model)
        step = make_step(cfg, policy, ref_model=copy.deepcopy(model).requires_grad_(False), packed_sequences=packed,
                         optim_batch_size=4, micro_batch_size=4, micro_batch_tokens=40)
        scored = batch.clone()
        scored["ref_log_probs"] = score_replies(scored, step.ref.scorer, step.s)
        torch.manual_seed(0)  # the same minibatches
        metrics = step.optimize(scored)
        outcomes.append((scored["ref_log_probs"], metrics, dict(policy.named_parameters())))
    (ref_d, metrics_d, weights_d), (ref_p, metrics_p, weights_p) = outcomes
    torch.testing.assert_close(ref_p, ref_d, atol=1e-5, rtol=1e-5)
    assert metrics_p["optim_steps"] == metrics_d["optim_steps"] >= 2 and metrics_p["micro_batches"] > 1
    for key in ("loss_objective", "entropy", "kl_to_inference", "clip_fraction", "grad_norm"):
        assert metrics_p[key] == pytest.approx(metrics_d[key], rel=1e-4, abs=1e-6), key
    for name, weight in weights_d.items():
        torch.testing.assert_close(weights_p[name], weight, atol=1e-6, rtol=1e-5)


GPU_BUSY_CYCLES = 2_000_000_000  # ~1 s of an H100's clock


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's queue is what is under test")
def test_on_a_gpu_a_packed_micro_batch_trains_without_waiting_for_the_gpu(setup):
    """``micro_on_device``: a packed micro-batch's forward and backward are queued while the GPU is still busy with
    what came before (the host neither syncs nor waits), with the loss and gradient of the micro-batch moved whole."""
    cfg, _, model, _, batch = setup
    cuda = torch.device("cuda")
    policy = ReplyLogProbs(copy.deepcopy(model).to(cuda, torch.bfloat16), packed=True)
    s = dataclasses.replace(GRPOSettings.from_config(cfg), packed_sequences=True)
    micro = trim_padding(batch)
    totals = LossTotals.of(micro)  # as optimize takes them: from the minibatch on the host

    def loss_and_gradient(on_device):
        policy.zero_grad(set_to_none=True)
        loss = weighted_loss(grpo_terms(policy, on_device, s, totals), s)
        loss.backward()
        return loss.detach(), [p.grad for p in policy.parameters()]

    expected = loss_and_gradient(micro.to(cuda))  # also the first calls' one-off set-up (cuBLAS handles)
    torch.cuda.synchronize()
    torch.cuda._sleep(GPU_BUSY_CYCLES)
    busy = torch.cuda.Event()
    busy.record()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss, gradient = loss_and_gradient(micro_on_device(micro, cuda, packed=True))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not busy.query(), "the micro-batch waited for the GPU"
    torch.testing.assert_close(loss, expected[0])
    for got, want in zip(gradient, expected[1], strict=True):
        torch.testing.assert_close(got, want)


def test_reference_scoring_in_micro_batches_equals_one_pass(setup):
    cfg, _, model, _, batch = setup
    settings = GRPOSettings.from_config(cfg)
    budget = 2 * int((batch["prompt_length"] + batch["reply_length"]).max())
    cut = score_replies(batch, ReplyLogProbs(model), dataclasses.replace(settings, micro_batch_size=3, micro_batch_tokens=budget))
    whole = score_replies(batch, ReplyLogProbs(model), dataclasses.replace(settings, micro_batch_size=8, micro_batch_tokens=None))
    torch.testing.assert_close(cut, whole, atol=1e-5, rtol=1e-5)
    mask = batch["reply_mask"]
    torch.testing.assert_close(whole[mask], batch["behaviour_log_probs"][mask], atol=1e-4, rtol=1e-4)


def test_importance_sampling_scores_the_trainer_log_probs_in_prepare(setup):
    """With a mode on, prepare scores the replies with the trainer and weighs them (grpo.training.importance; the loss
    and gradient of each mode: tests/test_importance.py): with the sampler's weights, every weight is ~1."""
    cfg, tok, model, rollouts, _ = setup
    step = make_step(cfg, model, importance_sampling="sequence_mask", micro_batch_size=3)
    batch, stats = step.prepare(Replies.from_collector(rollouts))
    mask = batch["reply_mask"]
    torch.testing.assert_close(batch["trainer_log_probs"] * mask, batch["behaviour_log_probs"] * mask,
                               atol=1e-4, rtol=1e-4)
    assert stats["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert stats["mismatch/masked_token_fraction"] == stats["mismatch/masked_reply_fraction"] == 0


def test_under_autocast_the_log_probs_scored_before_the_update_are_those_the_loss_takes(setup):
    """Mixed precision: the trainer's log-probs that importance sampling scores before the update come from the same
    bf16 autocast pass as the loss's (``ReplyLogProbs``' ``autocast_dtype``), so before any update the ratio is 1,
    with float32 weights off the bf16 grid as training leaves them. Scored in float32 while the loss autocast, the
    real 0.5B's ratios spread (effective sample size 0.31 by step 5) and its accuracy fell to 0 (async, an H200)."""
    cfg, tok, model, rollouts, _ = setup
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + 1e-3 * torch.randn_like(p, generator=torch.Generator().manual_seed(0)))
        settings = dataclasses.replace(GRPOSettings.from_config(cfg), importance_sampling="token_truncate",
                                       micro_batch_size=3)
        policy = ReplyLogProbs(model, packed=settings.packed_sequences, autocast_dtype=torch.bfloat16)
        optim = optimizer_settings(cfg)
        optimizer = make_optimizer(optim, model)
        step = GRPOStep(settings, policy=policy, optimizer=optimizer, scheduler=make_scheduler(optim, optimizer),
                        pad_token_id=tok.pad_token_id)
        batch, _ = step.prepare(Replies.from_collector(rollouts))
        terms = grpo_terms(policy, batch, settings)
        assert float(terms["clip_fraction"]) == 0 and float(terms["kl_approx"]) == pytest.approx(0, abs=1e-6)
        assert float(terms["ess"]) == pytest.approx(1, abs=1e-6)
        mask = batch["reply_mask"]
        float32 = score_replies(batch, ReplyLogProbs(model, packed=settings.packed_sequences), settings)
        assert float((float32 - batch["trainer_log_probs"])[mask].abs().max()) > 1e-2  # what it took before
    finally:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(before[n])


def test_compiled_loss_matches_eager_in_value_and_gradient(setup):
    """train_model.compile=true runs the same maths: loss, metrics and gradients match the eager
    objective, on micro-batches of two different widths. The decoder layers share one compiled graph, the
    LM head's log-probs have one (dynamic shapes serve both widths), and a pass without grad stays eager."""
    cfg, _, model, _, batch = setup
    batch = batch.clone()
    batch["advantage"] = torch.linspace(-1.0, 1.0, batch.shape[0])
    settings = GRPOSettings.from_config(cfg)
    compiled_model = copy.deepcopy(model)
    step = make_step(cfg, compiled_model, compile=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    first = trim_padding(batch[:4])
    for part in (first, trim_padding(batch[4:])):
        results = []
        for m in (model, compiled_model):
            m.zero_grad(set_to_none=True)
            out = grpo_terms(ReplyLogProbs(m) if m is model else step.policy, part, settings)
            weighted_loss(out, settings).backward()
            results.append((out, [p.grad.clone() for p in m.parameters()]))
        compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        assert compiled_graphs == 2 or part is not first  # one graph for the 3 layers, one for the head
        (out_e, grads_e), (out_c, grads_c) = results
        for key in ("objective", "entropy", "clip_fraction", "ess", "kl_approx"):
            torch.testing.assert_close(out_c[key], out_e[key], atol=1e-5, rtol=1e-4)
        for g_c, g_e in zip(grads_c, grads_e):
            torch.testing.assert_close(g_c, g_e, atol=1e-5, rtol=1e-3)
    assert compiled_graphs <= 3  # the other width adds none (a micro-batch without padding has no mask: one more)
    with torch.no_grad():
        step.policy(batch["input_ids"][:2], batch["attention_mask"][:2], batch["reply_mask"].shape[1],
                    with_entropy=False, entropy_grad=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == compiled_graphs  # eager without grad
    model.zero_grad(set_to_none=True)


def test_compiled_reference_scores_as_eager_in_one_graph_per_part(setup):
    """train_model.compile compiles the reference's scoring too (it never generates): the same log-probs as the
    eager reference, from one graph for the layers and one for the head, without grad."""
    cfg, _, model, _, batch = setup
    settings = GRPOSettings.from_config(cfg)
    step = make_step(cfg, copy.deepcopy(model), ref_model=copy.deepcopy(model).requires_grad_(False), compile=True)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    cut = dataclasses.replace(settings, micro_batch_size=4, micro_batch_tokens=None)
    scored = score_replies(batch, step.ref.scorer, cut)
    assert 2 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs <= 3  # (+1: a micro-batch without a mask)
    torch.testing.assert_close(scored, score_replies(batch, ReplyLogProbs(model), cut), atol=1e-5, rtol=1e-4)


def test_default_master_weights_apply_updates_of_the_default_learning_rate():
    """The real job's AdamW steps are ~lr = 2e-6; next to a weight of ~0.02 that is below bfloat16's
    spacing (~1e-4), so bf16 master weights barely moved. The default keeps float32 master weights
    (bf16 compute under autocast), where every weight with a gradient moves."""
    cfg = compose("grpo_gsm8k")
    master = torch_dtype(cfg.train_model.dtype, torch.device("cuda"))
    assert master == torch.float32

    def changed_fraction(dtype: torch.dtype) -> float:
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256, bias=False).to(dtype)
        torch.nn.init.normal_(model.weight, std=0.02)
        before = model.weight.detach().clone()
        optimizer = make_optimizer(OptimizerSettings.from_config(cfg), model)
        for _ in range(4):
            model.weight.grad = torch.randn_like(model.weight)
            optimizer.step()
        return float((model.weight != before).float().mean())

    assert changed_fraction(master) > 0.99
    assert changed_fraction(torch.bfloat16) < 0.1  # what the old default did


def variant_terms(cfg, model, batch, variant: str) -> dict:
    cfg = cfg.copy()
    cfg.train.loss_variant = variant
    return terms_of(cfg, model, batch)


def test_dr_grpo_sums_tokens_over_a_constant_and_keeps_the_advantage_unscaled(setup):
    """Dr. GRPO: loss = -sum_tokens min(r A, clip(r) A) / (replies x max_new_tokens); A = r - group mean."""
    cfg, model, batch, cur = known_ratios(setup)
    total = 0.0
    for i in range(8):
        n = int(batch["reply_length"][i])
        ratio = (cur[i, :n] - batch["behaviour_log_probs"][i, :n]).exp()
        total += float(hand_gain(ratio, ADVANTAGES[i], cfg).sum())
    out = variant_terms(cfg, model, batch, "dr_grpo")
    assert float(out["objective"]) == pytest.approx(-total / (8 * cfg.inference_model.max_new_tokens), rel=1e-4)
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.5]), torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert group_advantages(rewards, groups, scale_by_std=False).tolist() == [0.75, -0.25, -0.25, -0.25,
                                                                              0.125, 0.125, 0.125, -0.375]


def test_gspo_clips_one_geometric_mean_ratio_per_reply(setup):
    """GSPO: s_i = exp(mean_t log r_t); loss = -mean_i min(s_i A_i, clip(s_i) A_i)."""
    shift = torch.tensor([0.5, -0.5, 0.05, -0.05, 0.4, 0.0, -0.4, 0.1])  # per-reply ratios of about exp(shift)
    cfg, model, batch, cur = known_ratios(
        setup, lambda b: _perturbed_old_log_probs(b, scale=0.3) - shift[:, None] * b["reply_mask"])
    eps_low, eps_high = cfg.train.clip_epsilon_low, cfg.train.clip_epsilon_high
    gains, clipped = [], 0
    for i in range(8):
        n = int(batch["reply_length"][i])
        seq = (cur[i, :n] - batch["behaviour_log_probs"][i, :n]).mean().exp()
        gains.append(hand_gain(seq, ADVANTAGES[i], cfg))
        clipped += int(seq < 1 - eps_low or seq > 1 + eps_high)
    out = variant_terms(cfg, model, batch, "gspo")
    assert float(out["objective"]) == pytest.approx(float(-torch.stack(gains).mean()), rel=1e-4, abs=1e-6)
    assert float(out["clip_fraction"]) == pytest.approx(clipped / 8)
    assert 0 < clipped < 8, "the test needs clipped and unclipped replies"


def test_overlong_penalty_is_zero_then_linear_over_the_buffer():
    lengths = torch.tensor([10, 16, 17, 20, 24])
    assert overlong_penalty(lengths, 24, 8, 0.5).tolist() == [0.0, 0.0, 0.5 / 8, 0.5 * 4 / 8, 0.5]


def rollouts_with_stops(replies: list[list[int]], rewards: list[float], stop: int):
    """Pairs of replies to one prompt; random sampler log-probs; ``stop`` ends a reply (one without it was cut:
    truncated, as the episode policy marks it)."""
    g = torch.Generator().manual_seed(0)
    return Replies.from_sequences(
        prompts=[[5, 6, 10 + i // 2] for i in range(len(replies))], replies=replies,
        log_probs=[-torch.rand(len(reply), generator=g) - 0.5 for reply in replies], reward=rewards,
        success=[reward > 0 for reward in rewards], row_index=[i // 2 for i in range(len(replies))],
        user_prompts=[f"prompt {i // 2}" for i in range(len(replies))],
        truncated=[reply[-1] != stop for reply in replies])


def test_overlong_shaping_penalises_then_filters_cut_replies_out_of_the_loss(setup):
    """Soft penalty on the reward before the advantages; cut replies (no stop token within
    max_new_tokens=4) stay in their group's baseline but out of every loss term."""
    cfg, _, model, _, _ = setup
    stop = 3
    replies = [[8, stop], [8, 9, 11, 12], [8, 9, stop], [8, 9, 11, stop], [9, 9, 9, 9], [8, stop]]
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    step = make_step(cfg, model, max_new_tokens=4, overlong_buffer=2, overlong_penalty=0.5, overlong_filter=True)
    step.pad_token_id = 0
    batch, metrics = step.prepare(rollouts_with_stops(replies, rewards, stop))
    shaped = [1.0, 0.0 - 0.5, 1.0 - 0.25, 1.0 - 0.5, 0.0 - 0.5, 1.0]  # lengths 2, 4, 3, 4, 4, 2
    assert batch["reward"].tolist() == pytest.approx(shaped)
    assert metrics["overlong_penalty_mean"] == pytest.approx(sum(r - s for r, s in zip(rewards, shaped)) / 6)
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    torch.testing.assert_close(batch["advantage"], group_advantages(torch.tensor(shaped), groups))
    cut = torch.tensor([False, True, False, False, True, False])
    assert not batch["reply_mask"][cut].any()
    assert batch["reply_mask"][~cut].sum(-1).tolist() == [2, 3, 4, 2]
    kept = batch[~cut]
    with torch.no_grad():
        filtered, only_stopped = terms_of(cfg, model, batch), terms_of(cfg, model, kept)
    for name in ("objective", "entropy", "kl_to_inference", "clip_fraction"):
        assert float(filtered[name]) == pytest.approx(float(only_stopped[name]), rel=1e-5, abs=1e-7), name
