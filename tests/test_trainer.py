"""The GRPO loss and the group advantage against hand computations on small real batches."""

import math

import pytest
import torch
from tensordict import TensorDict, lazy_stack
from torchrl.collectors.llm import LLMCollector

from conftest import compose
from grpo.envs import make_env
from grpo.models import generate_kwargs, load_policy_model, load_tokenizer, make_scoring_wrapper, make_transformers_policy
from grpo.rollouts import prepare_rollouts
from grpo.setup import resolve_local_paths
from grpo.trainer import make_loss, make_replay_buffer


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tiny_data_dir):
    torch.manual_seed(0)
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}", "env.repeats=4",
                                "env.num_envs=8", "train.dialog_turns_per_batch=8", "train.optim_batch_size=8",
                                "inference_model.max_new_tokens=12"])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    model = load_policy_model(cfg, tok, torch.device("cpu"))
    env = make_env(cfg, tok, split="train", repeats=4, num_envs=8)
    policy = make_transformers_policy(model, tok, gen_kwargs=generate_kwargs(cfg, tok, greedy=False, max_new_tokens=12))
    batch = next(iter(LLMCollector(env, policy=policy, dialog_turns_per_batch=8, total_dialog_turns=-1))).reshape(-1)
    prepare_rollouts(batch, ref_wrapper=None, ref_device=None, kl_to_ref_coeff=0.0, kl_in_reward=False)
    return cfg, tok, model, batch


def reply_log_probs(model, sample) -> torch.Tensor:
    """log pi(token_t | tokens_<t) of the reply tokens, straight from the HF model."""
    full = sample["tokens", "full"]
    n = sample["tokens", "response"].shape[-1]
    logits = model(full[None]).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, full[1:, None]).squeeze(-1)
    return lp[-n:]


def test_behaviour_log_probs_are_the_samplers(setup):
    """Collected log-probs equal the generating model's, first reply token included (TorchRL zeroes it)."""
    _, _, model, batch = setup
    with torch.no_grad():
        for sample in batch.unbind(0):
            n = sample["tokens", "response"].shape[-1]
            torch.testing.assert_close(sample["log_probs", "full"][-n:], reply_log_probs(model, sample),
                                       atol=1e-4, rtol=1e-4)


def test_group_advantage_is_standardised_reward(setup):
    cfg, _, _, batch = setup
    batch = batch.clone()
    rewards = torch.tensor([1.0, 0.0, 0.1, 1.0, 0.0, 0.0, 0.0, 1.1])
    batch.set(("next", "reward"), rewards.view(8, 1, 1))
    buffer = make_replay_buffer(cfg)
    buffer.extend(batch)
    stored = buffer[:]
    assert len(buffer) == 8
    by_query: dict[str, list[tuple[float, float]]] = {}
    for s in stored.unbind(0):
        by_query.setdefault(s["query"], []).append((float(s["next", "reward"].flatten()[0]),
                                                    float(s["advantage"].flatten()[0])))
    assert len(by_query) == 2
    for pairs in by_query.values():
        r = [p[0] for p in pairs]
        mean = sum(r) / len(r)
        std = math.sqrt(sum((x - mean) ** 2 for x in r) / (len(r) - 1))  # unbiased, as torch.std
        for reward, adv in pairs:
            assert adv == pytest.approx((reward - mean) / max(std, 1e-6), abs=1e-5)


def test_clipped_loss_matches_hand_computation(setup):
    """Known importance ratios and advantages: loss = -mean_tokens min(r A, clip(r, 1-el, 1+eh) A)."""
    cfg, tok, model, batch = setup
    batch = batch.clone()
    cfg = cfg.copy()
    cfg.train.use_kl_to_ref = False
    loss_fn = make_loss(cfg, make_scoring_wrapper(model, tok))
    eps_low, eps_high = cfg.train.clip_epsilon_low, cfg.train.clip_epsilon_high
    gen = torch.Generator().manual_seed(1)
    advantages = torch.tensor([1.0, -1.0, 0.5, -2.0, 1.5, -0.5, 2.0, -1.5])
    gains, clipped, count = [], 0, 0
    with torch.no_grad():
        for i, sample in enumerate(batch.unbind(0)):
            cur = reply_log_probs(model, sample)
            log_ratio = (torch.rand(cur.shape, generator=gen) - 0.5) * 1.2  # ratios in [0.55, 1.82]
            prev = cur - log_ratio
            full = sample["log_probs", "full"].clone()
            full[-cur.numel():] = prev
            sample.set(("log_probs", "full"), full)
            ratio = log_ratio.exp()
            a = advantages[i]
            gains.append(torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a))
            clipped += int(((ratio < 1 - eps_low) | (ratio > 1 + eps_high)).sum())
            count += cur.numel()
    batch.set("advantage", advantages.view(8, 1, 1))
    out = loss_fn(batch)
    expected = -torch.cat(gains).sum() / count
    assert float(out.loss_objective) == pytest.approx(float(expected), rel=1e-4, abs=1e-5)
    assert float(out.clip_fraction) == pytest.approx(clipped / count, abs=1e-6)
    assert 0 < float(out.ESS) < 1


def test_kl_to_ref_penalty_is_masked_k3(setup):
    cfg, tok, model, batch = setup
    batch = batch.clone()
    cfg = cfg.copy()
    cfg.train.kl_to_ref_coeff = 0.5
    loss_fn = make_loss(cfg, make_scoring_wrapper(model, tok))
    diffs = []
    with torch.no_grad():
        for sample in batch.unbind(0):
            cur = reply_log_probs(model, sample)
            ref = cur + 0.3 * torch.randn(cur.shape)
            full = torch.zeros_like(sample["log_probs", "full"])
            full[-cur.numel():] = ref
            sample.set(("ref_log_probs", "full"), full)
            diffs.append(ref - cur)
    batch.set("advantage", torch.zeros(8, 1, 1))
    out = loss_fn(batch)
    d = torch.cat(diffs)
    expected_kl = (d.expm1() - d).mean()
    assert float(out.kl_to_ref) == pytest.approx(float(expected_kl), rel=1e-4)
    assert float(out.loss_kl_to_ref) == pytest.approx(0.5 * float(expected_kl), rel=1e-4)


def test_kl_in_reward_lowers_reward_by_coeff_times_kl():
    from grpo.rollouts import apply_kl_reward_penalty

    samples = []
    for n_prompt, beh, ref in [(3, [-1.0, -2.0], [-1.5, -2.0]), (2, [-0.5], [-0.1])]:
        tokens = torch.arange(n_prompt + len(beh))
        samples.append(TensorDict({
            "tokens": TensorDict({"response": tokens[n_prompt:], "full": tokens}),
            "log_probs": TensorDict({"full": torch.tensor([0.0] * n_prompt + beh)}),
            "ref_log_probs": TensorDict({"full": torch.tensor([0.0] * n_prompt + ref)}),
            ("next", "reward"): torch.ones(1, 1),
        }))
    data = lazy_stack(samples)
    apply_kl_reward_penalty(data, 0.2)

    def k3(beh, ref):
        d = torch.tensor(ref) - torch.tensor(beh)
        return float((d.expm1() - d).mean())

    got = data.get(("next", "reward")).flatten().tolist()
    assert got[0] == pytest.approx(1 - 0.2 * k3([-1.0, -2.0], [-1.5, -2.0]), abs=1e-6)
    assert got[1] == pytest.approx(1 - 0.2 * k3([-0.5], [-0.1]), abs=1e-6)
