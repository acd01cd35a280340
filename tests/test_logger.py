"""grpo/loop/logger.py: the metrics file survives as rows are written; the profiler writes its files; replies
to read come out of real rollouts with their prompts and rewards."""

import gzip
import json

import pytest
import torch

from conftest import compose
from grpo.inference.decoding import ReplySampler
from grpo.inference.engine import make_transformers_policy
from grpo.inference.generation import EngineSettings, generate_kwargs
from grpo.loop.logger import RunLogger, profile_to, read_metrics, reply_samples
from grpo.loop.settings import RecordSettings
from grpo.tasks.envs import load_gsm8k, make_collector, make_env
from grpo.tasks.settings import TaskSettings
from grpo.training.models import load_causal_lm, load_tokenizer, stop_token_ids
from grpo.training.replies import Replies


def test_profile_to_writes_an_op_table_and_a_trace(tmp_path):
    with profile_to(tmp_path, step=3):
        a = torch.randn(64, 64)
        (a @ a).sum()
    table = (tmp_path / "profile_step3.txt").read_text()
    assert "aten::mm" in table
    with gzip.open(tmp_path / "profile_step3.json.gz", "rt") as f:
        trace = json.load(f)
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
    assert not (tmp_path / "profile_step3.json").exists()


def test_read_metrics_reads_every_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "reward": 0.5}) + "\n\n" + json.dumps({"step": 2, "reward": 0.7}) + "\n")
    assert [r["reward"] for r in read_metrics(path)] == [0.5, 0.7]


@pytest.fixture(scope="module")
def rollouts(tiny_model_dir, tiny_data_dir):
    """One collected batch of the tiny task: 2 prompts x 4 sampled replies, as the collector hands it over."""
    cfg = compose("grpo_tiny", [f"model.name={tiny_model_dir}", f"env.dataset={tiny_data_dir}"])
    tok = load_tokenizer(cfg.model.name)
    model = load_causal_lm(cfg.model.name, tok, dtype=torch.float32, device=torch.device("cpu")).eval()
    stop_ids = stop_token_ids(tok, model.generation_config)
    sampler = ReplySampler(model, compile=False, cache_bucket=64, compact_rows=True)
    policy = make_transformers_policy(sampler, tok, gen_kwargs=generate_kwargs(
        EngineSettings.from_config(cfg), tok, greedy=False, max_new_tokens=24, stop_ids=stop_ids))
    torch.manual_seed(0)
    env = make_env(TaskSettings.from_config(cfg), tok, split="train", repeats=4, num_envs=8)
    return next(iter(make_collector(env, policy, 8))).reshape(-1), tok, stop_ids, load_gsm8k(str(tiny_data_dir), "train")


def test_samples_are_the_first_prompts_replies_with_their_rewards(rollouts):
    batch, tok, stop_ids, data = rollouts
    rows = batch["row_index"].tolist()
    rewards = batch.get(("next", "reward")).flatten().tolist()
    firsts = list(dict.fromkeys(rows))
    assert len(firsts) == 2
    samples = reply_samples(Replies.from_collector(batch), 1, tok)
    picked = [i for i, row in enumerate(rows) if row == firsts[0]]
    assert len(samples) == len(picked) == 4
    for sample, i in zip(samples, picked):  # the reply as TorchRL's transformers wrapper parsed it, too
        assert sample == {"group": 0, "row": firsts[0], "prompt": data[firsts[0]]["question"], "reward": rewards[i],
                          "reply": batch[i]["history", "response"].content[-1]}
    every = reply_samples(Replies.from_collector(batch), 5, tok)  # more than the batch holds: all of it
    assert [(s["group"], s["row"], s["reward"]) for s in every] == [(firsts.index(r), r, w) for r, w in zip(rows, rewards)]


def test_samples_are_in_the_file_as_soon_as_logged_and_on_the_console(rollouts, tmp_path, capsys):
    batch, tok, stop_ids, _ = rollouts
    samples = reply_samples(Replies.from_collector(batch), 2, tok)
    logger = RunLogger(tmp_path, RecordSettings.from_config(compose("grpo_tiny", ["logger=none"])), {})
    try:
        logger.log_samples(3, samples[:4])
        logger.log_samples(6, samples[4:])
        assert read_metrics(tmp_path / "samples.jsonl") == [{"step": s, **x} for s, x in zip([3] * 4 + [6] * 4, samples)]
    finally:
        logger.close()
    console = capsys.readouterr().out.splitlines()
    assert [line for line in console if line.startswith("step ")] == ["step 3: replies (all of them in samples.jsonl)",
                                                                      "step 6: replies (all of them in samples.jsonl)"]
    assert f"  row {samples[0]['row']}: {samples[0]['prompt']}" in console
    assert f"    {samples[0]['reward']:6.3f}  {samples[0]['reply']}" in console
