"""grpo/inference/engine.py: generation options through TorchRL's wrapper, and generation on the training
model object itself staying correct while it trains."""

import pytest
import torch

from conftest import compose, perturbed, reply_log_probs
from grpo.inference.decoding import ReplySampler
from grpo.inference.engine import TransformersInference, make_transformers_policy
from grpo.inference.generation import EngineSettings, InferenceEngine, generate_kwargs, weights_checksum
from grpo.tasks.paths import resolve_local_paths
from grpo.tasks.envs import make_collector, make_env
from grpo.tasks.settings import TaskSettings
from grpo.training.batch import to_training_batch
from grpo.training.logprobs import token_log_probs
from grpo.training.models import load_causal_lm, load_policy_model, load_tokenizer, stop_token_ids
from grpo.training.models import train_mode_if
from grpo.training.replies import Replies
from grpo.training.settings import ModelSettings


@pytest.fixture(scope="module")
def tiny(tiny_model_dir, tiny_data_dir):
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}", "env.repeats=4",
                                "env.num_envs=8", "inference_model.max_new_tokens=16"])
    resolve_local_paths(cfg)
    tok = load_tokenizer(cfg.model.name)
    model = load_causal_lm(cfg.model.name, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
    return cfg, tok, model


def collect(cfg, tok, model, gen_kwargs: dict, seed: int = 0):
    torch.manual_seed(seed)
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=4, num_envs=8, shuffle=False)
    sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
    policy = make_transformers_policy(sampler, tok, gen_kwargs=gen_kwargs)
    return next(iter(make_collector(env, policy, 8))).reshape(-1), policy


def sampled_rollouts(cfg, tok, model, *, seed=0, **overrides):
    stop_ids = stop_token_ids(tok, model.generation_config)
    for key, value in overrides.items():
        cfg.inference_model[key] = value
    options = generate_kwargs(EngineSettings.from_config(cfg), tok, greedy=False, max_new_tokens=24, stop_ids=stop_ids)
    rollouts, policy = collect(cfg, tok, model, options, seed=seed)
    return rollouts, policy, stop_ids


def test_replies_end_at_their_first_stop_token_when_the_model_pads_with_eos(tiny):
    """SmolLM2's generation_config pads with its eos, not with the tokenizer's pad: finished replies
    then came back followed by runs of eos with log-probs of -13, counted as reply tokens. The
    tokenizer's pad is now passed to generate, and TorchRL strips it."""
    cfg, tok, model = tiny
    saved = model.generation_config.pad_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    try:
        rollouts, policy, stop_ids = sampled_rollouts(cfg, tok, model)
    finally:
        model.generation_config.pad_token_id = saved
    assert policy.generate_kwargs["pad_token_id"] == tok.pad_token_id != tok.eos_token_id
    replies = [s["tokens", "response"] for s in rollouts.unbind(0)]
    stopped = [r for r in replies if torch.isin(r, torch.tensor(stop_ids)).any()]
    assert stopped, "the test needs replies that finished before max_new_tokens"
    assert len({r.numel() for r in replies}) > 1, "finished replies must keep their own length"
    for r in stopped:
        assert torch.isin(r[-1:], torch.tensor(stop_ids)).all() and not torch.isin(r[:-1], torch.tensor(stop_ids)).any()
    batch = to_training_batch(Replies.from_collector(rollouts), pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        trainer_lp = reply_log_probs(model, batch)
    mask = batch["reply_mask"]
    diff = (trainer_lp - batch["behaviour_log_probs"])[mask]
    assert float((diff.expm1() - diff).mean()) < 1e-3  # sampler/trainer KL before any update


@pytest.mark.parametrize("cut", [{"top_p": 0.5, "temperature": 0.7}, {"top_k": 2, "temperature": 1.5}],
                         ids=["top_p", "top_k"])
def test_with_top_k_or_top_p_sampler_and_trainer_score_one_distribution(tiny, cut):
    """The sampler reports the tempered distribution's log-prob before its top-k/top-p cut, the one the trainer
    scores: their KL before any update is ~0 (here 1.5e-3 and 2.1e-4 when the sampler reported the cut one's)."""
    cfg, tok, model = tiny
    saved = {key: cfg.inference_model[key] for key in cut}
    try:
        rollouts, _, _ = sampled_rollouts(cfg, tok, model, **cut)
    finally:
        for key, value in saved.items():
            cfg.inference_model[key] = value
    batch = to_training_batch(Replies.from_collector(rollouts), pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        lp, _ = token_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["reply_mask"].shape[1],
                                with_entropy=False, entropy_grad=False, temperature=cut.get("temperature", 1.0))
    mask = batch["reply_mask"]
    diff = (lp - batch["behaviour_log_probs"])[mask]
    assert float((diff.expm1() - diff).mean()) < 1e-6


def test_top_k_is_off_by_default_and_reaches_generate(tiny):
    """transformers samples with top_k=50 unless told otherwise. At a high temperature the tiny
    model (531 tokens) then samples tokens outside its top 50 only when top_k is really off."""
    cfg, tok, model = tiny
    assert cfg.inference_model.top_k == 0
    saved = cfg.inference_model.temperature, cfg.inference_model.top_k

    def outside_top(k_rank: int, **overrides) -> int:
        rollouts, policy, _ = sampled_rollouts(cfg, tok, model, **overrides)
        assert policy.generate_kwargs["top_k"] == cfg.inference_model.top_k
        batch = to_training_batch(Replies.from_collector(rollouts), pad_token_id=tok.pad_token_id)
        width_r = batch["reply_mask"].shape[1]
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
                           position_ids=(batch["attention_mask"].long().cumsum(-1) - 1).clamp_min(0)).logits
        logits = logits[:, -width_r - 1:-1]
        chosen = logits.gather(-1, batch["input_ids"][:, -width_r:, None])
        rank = (logits > chosen).sum(-1)  # 0 for the most likely token
        return int(((rank >= k_rank) & batch["reply_mask"]).sum())

    try:
        assert outside_top(50, temperature=20.0, top_k=0) > 0
        assert outside_top(50, temperature=20.0, top_k=50) == 0
        assert outside_top(3, temperature=20.0, top_k=3) == 0
    finally:
        cfg.inference_model.temperature, cfg.inference_model.top_k = saved


def greedy_replies(inference, cfg, tok) -> list[list[int]]:
    env = make_env(TaskSettings.from_config(cfg), tok, split="test", repeats=1, num_envs=8, shuffle=False)
    td = inference.greedy_policy(env.reset())
    return [s["tokens", "response"].tolist() for s in td.unbind(0)]


def test_generation_with_gradient_checkpointing_on_matches_generation_without(tiny_model_dir, tiny_data_dir):
    """A one-GPU run (and every CPU run) generates with the trained model object. With gradient
    checkpointing on, that model used to sit in train mode, where transformers drops generate()'s
    KV cache: the default job crashed on a GPU, and on CPU grpo_tiny's greedy accuracy fell to 0."""
    replies = {}
    for checkpointing in (False, True):
        cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}",
                                    f"train_model.gradient_checkpointing={checkpointing}"])
        resolve_local_paths(cfg)
        tok = load_tokenizer(cfg.model.name)
        model = load_policy_model(ModelSettings.from_config(cfg), tok, torch.device("cpu"))
        inference = TransformersInference(EngineSettings.from_config(cfg), model, tok, torch.device("cpu"),
                                          stop_token_ids(tok, model.generation_config))
        assert inference.model is model
        with train_mode_if(model, checkpointing):  # what optimisation does between two collections
            assert model.training is checkpointing
        assert not model.training
        replies[checkpointing] = greedy_replies(inference, cfg, tok)
    assert replies[True] == replies[False]
    assert any(tok.eos_token_id in r for r in replies[True])


def test_the_checksum_counts_tied_weights_once_and_ignores_fusing_and_zero_padding():
    """vLLM holds q/k/v as one tensor, pads the vocabulary with zero rows and the LM head once."""
    g = torch.Generator().manual_seed(0)
    q, k, v, embed = (torch.randn(shape, generator=g) for shape in ((8, 4), (2, 4), (2, 4), (5, 4)))
    hf_named = {"q": q, "k": k, "v": v, "embed": embed, "lm_head": embed}
    engine_held = [torch.cat([q, k, v]), torch.cat([embed, torch.zeros(3, 4)])]
    assert weights_checksum(hf_named) == weights_checksum(engine_held)
    nudged = q.clone()
    nudged[0, 0] = torch.nextafter(nudged[0, 0], torch.tensor(1.0))  # one bit of one weight
    assert weights_checksum(hf_named | {"q": nudged}) != weights_checksum(hf_named)


def test_transformers_engine_checksum_reads_its_weights_and_follows_a_push(tiny):
    """A rollout worker's engine: built from the model files (no trainer model), then pushed to."""
    cfg, tok, model = tiny
    inference = TransformersInference(EngineSettings.from_config(cfg), None, tok, torch.device("cpu"),
                                      stop_token_ids(tok, model.generation_config))
    assert isinstance(inference, InferenceEngine) and inference.version is None and inference.model is not model
    assert inference.weights_checksum() == weights_checksum(model.state_dict())
    new = perturbed(model.state_dict(), seed=1)
    inference.push_weights(new, version=3)
    assert inference.version == 3
    assert inference.weights_checksum() == weights_checksum(new) != weights_checksum(model.state_dict())


@pytest.mark.parametrize("compact_rows", [False, True])
def test_inference_model_compact_rows_reaches_the_decode_loop_and_replies_come_back_whole(tiny, compact_rows):
    """Through the engine and TorchRL's wrapper: with ``inference_model.compact_rows`` on, 64 replies that end at
    spread-out lengths (the token "The" stops them too) decode in batches that halve, and every reply comes back
    as its tokens up to its first stop token, with a log-prob for each; the engine hands the reference
    (``on_sampled``) the same prompts and replies, as they leave the decode loop."""
    cfg, tok, model = tiny
    cfg = compose("grpo_tiny", [f"model.name={cfg.model.name}", f"env.dataset={cfg.env.dataset}", "env.repeats=8",
                                "env.num_envs=64", "inference_model.max_new_tokens=48",
                                f"inference_model.compact_rows={compact_rows}"])
    stop_ids = stop_token_ids(tok, model.generation_config) + tok.convert_tokens_to_ids(["The"])
    engine = TransformersInference(EngineSettings.from_config(cfg), None, tok, torch.device("cpu"), stop_ids)
    handed = []
    engine.on_sampled = lambda prompts, replies: handed.append((prompts, replies))
    torch.manual_seed(0)
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=8, num_envs=64)
    replies = Replies.from_collector(next(iter(make_collector(env, engine.policy, 64))))
    (prompts, sampled), = handed
    assert all(torch.equal(a, b) for a, b in zip(prompts, replies.prompts(), strict=True))
    assert all(torch.equal(a[:len(b)], b) and (len(a) == len(b) or torch.isin(b[-1], torch.tensor(stop_ids)))
               for a, b in zip(sampled, replies.replies(), strict=True))
    sizes = engine.sampler.batch_sizes
    assert sizes[0] == 64 and (len(sizes) > 1) == compact_rows
    for reply, log_probs in zip(replies.replies(), replies.log_probs()):
        ends = torch.isin(reply, torch.tensor(stop_ids)).nonzero()[:, 0].tolist()
        assert ends == [len(reply) - 1] or (not ends and len(reply) == 48)
        assert (log_probs < 0).all()


def test_the_sampled_eval_samples_at_eval_temperature_with_the_eval_cap(tiny_model_dir, tiny_data_dir):
    """eval.samples_per_problem's replies: sampled as rollouts are (top_p, top_k) but at eval.temperature, cut at
    eval.max_new_tokens; the greedy eval and the rollouts keep their own."""
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}", "eval.temperature=0.6",
                                "eval.max_new_tokens=12", "inference_model.top_p=0.9"])
    tok = load_tokenizer(cfg.model.name)
    inference = TransformersInference(EngineSettings.from_config(cfg), None, tok, torch.device("cpu"), [tok.eos_token_id])
    sampled, greedy, rollouts = (p.generate_kwargs for p in (inference.sampled_eval_policy, inference.greedy_policy,
                                                             inference.policy))
    assert (sampled["do_sample"], sampled["temperature"], sampled["top_p"], sampled["max_new_tokens"]) == (True, 0.6, 0.9, 12)
    assert not greedy["do_sample"] and greedy["max_new_tokens"] == 12
    assert (rollouts["temperature"], rollouts["max_new_tokens"]) == (1.0, 24)
