"""train.importance_sampling (grpo.training.importance): each mode's loss and gradient, for each loss variant, against
the formula written out, on a small batch whose log-probs are the parameters themselves."""

import pytest
import torch
from tensordict import TensorDict

from grpo.training.importance import add_importance_weights, importance_weights
from grpo.training.step import GRPOSettings, grpo_terms, loss_mask

EPS_LOW, EPS_HIGH, LOW, HIGH, MAX_NEW = 0.2, 0.28, 0.5, 2.0, 6
LENGTHS = [5, 3, 4, 2]
ADVANTAGE = torch.tensor([1.0, -1.0, 0.5, -2.0])
# trainer - sampler per token: replies' sums 0.1, 1.5, -1.0, 0.3 (weights 1.1, 4.5, 0.37, 1.35: two out of [0.5, 2])
GAP = torch.tensor([[0.9, -0.8, 0.3, -0.9, 0.6], [0.2, 0.9, 0.4, 0, 0], [-0.1, -0.8, 0.2, -0.3, 0], [1.0, -0.7, 0, 0, 0]])
# current - trainer: some ratios clipped either way
STEP = torch.tensor([[0.1, 0.4, -0.3, 0.05, -0.1], [-0.4, 0.1, 0.3, 0, 0], [0.2, -0.05, 0.35, -0.1, 0], [-0.1, -0.5, 0, 0, 0]])
MODES = ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def settings(mode, variant) -> GRPOSettings:
    return GRPOSettings(
        clip_epsilon_low=EPS_LOW, clip_epsilon_high=EPS_HIGH, kl_to_ref_coeff=0.0, kl_coef_in_loss=True,
        overlong_filter=False, overlong_buffer=0, overlong_penalty=0.0, kl_to_inference_coeff=0.0, entropy_coeff=0.0,
        aggregation="token_mean", loss_variant=variant, max_new_tokens=MAX_NEW, temperature=1.0,
        importance_sampling=mode, is_low=LOW, is_high=HIGH, epochs=1, optim_batch_size=4, micro_batch_size=4,
        micro_batch_tokens=None, packed_sequences=False, ref_micro_batch_tokens=None, clip_grad_norm=1.0,
        gradient_checkpointing=False, compile=False, on_nonfinite="stop")


def small_batch():
    mask = torch.arange(5) < torch.tensor(LENGTHS)[:, None]
    sampler = -1.0 - torch.rand(4, 5, generator=torch.Generator().manual_seed(0))
    batch = TensorDict({"input_ids": torch.zeros(4, 7, dtype=torch.long), "attention_mask": torch.ones(4, 7),
                        "reply_mask": mask, "behaviour_log_probs": sampler * mask,
                        "trainer_log_probs": (sampler + GAP) * mask, "advantage": ADVANTAGE}, batch_size=[4])
    return batch, mask


def hand_weights(mode, batch, mask):
    """w_t = pi_trainer / pi_sampler, or per reply W = prod_t w_t on each of its tokens; truncated: min(w, HIGH);
    masked: w where LOW <= w <= HIGH, else 0."""
    w = (batch["trainer_log_probs"] - batch["behaviour_log_probs"]).exp()
    if mode == "none":
        return torch.ones(4, 5)
    if mode.startswith("sequence"):
        w = torch.stack([w[i, :n].prod() for i, n in enumerate(LENGTHS)])[:, None].expand(4, 5)
    if mode.endswith("truncate"):
        return w.clamp(max=HIGH)
    return torch.where((w >= LOW) & (w <= HIGH), w, 0.0)


@pytest.mark.parametrize("variant", ["grpo", "dr_grpo", "gspo"])
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_weighs_loss_and_gradient_as_written_out(mode, variant):
    """r = pi / pi_old (pi_old: the sampler with none, else the trainer), g(r, A) = min(r A, clip(r, 1-el, 1+eh) A),
    and d/d log pi of g is r A where the unclipped term is the minimum, else 0. With weights w (hand_weights):
      grpo      loss = -sum_t w_t g(r_t, A) / N                      grad_t = -w_t r_t A active_t / N
      dr_grpo   loss = -sum_t w_t g(r_t, A) / (S max_new_tokens)     grad_t = -w_t r_t A active_t / (S max_new_tokens)
      gspo      s = exp(mean_t log r_t) per reply,
                loss = -sum_i mean_t(w_t) g(s_i, A_i) / S            grad_t = -w_t s_i A_i active_i / (n_i S)
    (N: tokens, S: replies, n_i: reply i's tokens)."""
    batch, mask = small_batch()
    s = settings(mode, variant)
    add_importance_weights(batch, loss_mask(batch), mode, LOW, HIGH)
    old = batch["behaviour_log_probs"] if mode == "none" else batch["trainer_log_probs"]
    cur = torch.nn.Parameter((old + STEP) * mask)
    terms = grpo_terms(lambda *args, **kw: (cur * 1.0, torch.zeros(4, 5)), batch, s)
    (grad,) = torch.autograd.grad(terms["objective"], cur)

    w, a, n = hand_weights(mode, batch, mask), ADVANTAGE[:, None], torch.tensor(LENGTHS)[:, None]
    if variant == "gspo":
        r = ((cur.detach() - old) * mask).sum(-1, keepdim=True).div(n).exp().expand(4, 5)
    else:
        r = (cur.detach() - old).exp()
    gain = torch.minimum(r * a, r.clamp(1 - EPS_LOW, 1 + EPS_HIGH) * a)
    active = ((a > 0) & (r < 1 + EPS_HIGH)) | ((a < 0) & (r > 1 - EPS_LOW))
    if variant == "gspo":
        loss = -((w * gain * mask).sum(-1) / n[:, 0]).sum() / 4
        expected_grad = -w * r * a * active / (n * 4)
    else:
        scale = mask.sum() if variant == "grpo" else 4 * MAX_NEW
        loss = -(w * gain * mask).sum() / scale
        expected_grad = -w * r * a * active / scale
    assert 0 < int((~active & mask).sum()) < int(mask.sum()), "the test needs clipped and unclipped terms"
    torch.testing.assert_close(terms["objective"], loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad * mask, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES[1:])
def test_weights_and_their_metrics(mode):
    """The weights prepare stores, their mean, and the share of tokens (sequence modes: and of replies) whose weight
    the bounds changed."""
    batch, mask = small_batch()
    metrics = add_importance_weights(batch, mask, mode, LOW, HIGH)
    expected = hand_weights(mode, batch, mask) * mask
    torch.testing.assert_close(batch["is_weight"], expected, atol=1e-6, rtol=1e-5)
    assert metrics["mismatch/is_weight_mean"] == pytest.approx(float(expected.sum() / mask.sum()), rel=1e-5)
    unbounded = GAP.exp() if mode.startswith("token") else GAP.sum(-1, keepdim=True).exp().expand(4, 5)
    out = unbounded > HIGH if mode.endswith("truncate") else (unbounded > HIGH) | (unbounded < LOW)
    assert 0 < metrics["mismatch/masked_token_fraction"] == pytest.approx(float((out & mask).sum() / mask.sum()))
    if mode.startswith("sequence"):  # reply 1's 4.5 is above the bounds, reply 2's 0.37 below
        assert metrics["mismatch/masked_reply_fraction"] == (0.25 if mode == "sequence_truncate" else 0.5)
    else:
        assert "mismatch/masked_reply_fraction" not in metrics


def test_a_long_replys_weight_neither_overflows_nor_turns_nan():
    """A reply's product of ratios past float32 (a log-ratio of 100): capped, or masked, never inf or NaN."""
    gap = torch.full((1, 200), 0.5)
    mask = torch.ones(1, 200, dtype=torch.bool)
    truncated, changed = importance_weights(gap, torch.zeros(1, 200), mask, "sequence_truncate", LOW, HIGH)
    assert torch.equal(truncated, torch.full((1, 200), HIGH)) and changed.all()
    masked, _ = importance_weights(gap, torch.zeros(1, 200), mask, "sequence_mask", LOW, HIGH)
    assert torch.equal(masked, torch.zeros(1, 200))
