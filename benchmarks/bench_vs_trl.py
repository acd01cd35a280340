#!/usr/bin/env python
"""This project's sync GRPO next to TRL's ``GRPOTrainer``: same model, data, knobs; one invocation.

    python benchmarks/bench_vs_trl.py --steps 30 --out results.json           # CPU, embedded tiny model
    python benchmarks/bench_vs_trl.py --device cuda --random-init-shape qwen2.5-0.5b \\
        --steps 8 --max-new-tokens 256 --eval-problems 64 --out gpu.json           # GPU speed run
    python benchmarks/bench_vs_trl.py --only ours ...                            # one side only
    python benchmarks/bench_vs_trl.py --train-minutes 15 --steps 1000 ...          # the same clock for both sides
    python benchmarks/bench_vs_trl.py --combine ours.json trl.json --out both.json  # two --only runs as one

Each side runs in its own child process, one after the other, so that peak memory is per side:
(a) ours: ``python grpo/grpo.py --config-name grpo_tiny hydra.run.dir=<tmp> key=value ...``
(b) TRL:  ``python benchmarks/bench_vs_trl.py --worker trl --spec <tmp>/spec.json`` (``GRPOTrainer``
    in that process, ``use_vllm=False``: both sides generate with transformers' ``generate``; with
    ``--trl-vllm colocate`` TRL generates with vLLM in that process, on the same GPU).
Needs the ``bench`` extra (``trl``) for (b); ours needs nothing beyond the project.

What is measured, per side
    * samples/s and generated (reply) tokens/s of a whole GRPO step = one generation batch plus
      every optimiser step trained on it; averaged over steps 2..N (step 1 pays one-time warm-up).
    * the step's time split: rollout (sampling + reward), log-prob/reference scoring,
      train (loss forward, backward, clip, optimiser) and, for ours, the rest (advantages, weight sync).
      Ours from its ``metrics.jsonl`` (generation_s, reference_s, train_s, weight_sync_s,
      step_time_s); TRL by wrapping ``_generate``, ``_calculate_rewards``,
      ``_generate_and_score_completions`` and timing optimiser steps in a ``TrainerCallback``.
    * peak memory: the child's max RSS (``os.wait4``); on CUDA also
      ``torch.cuda.max_memory_allocated`` (an ``atexit`` hook loaded through ``sitecustomize``, so
      ours still runs as the plain ``python grpo/grpo.py`` command).
    * held-out greedy accuracy with ONE evaluator: the project's own (``grpo.loop.evaluation.evaluate``
      over a ``GSM8KTaskEnv`` on the test split with a greedy transformers policy), which is what
      our run logs as ``eval/accuracy``. TRL's model is evaluated with it at the same steps (outside
      the timed steps); our final checkpoint is re-evaluated with it in a separate process to check
      that the number matches the logged one.
    * wall clock for the plot: training time only (the sum of step times; evals and start-up are
      left out, their seconds are reported separately).

Knob mapping. One GRPO step = P prompts x G replies (S = P*G samples), then E passes over them in
minibatches of M samples, each split into A micro-batches (M/A samples per forward/backward):

    knob (CLI)              ours (Hydra key)                            TRL (GRPOConfig)
    --repeats G             env.repeats                                 num_generations
    --prompts-per-step P    env.num_envs = train.dialog_turns_per_batch generation_batch_size = S
                            = S (one generation batch per step)         (steps_per_generation = S/(M/A), derived)
    --optim-batch-size M    train.optim_batch_size                      per_device_train_batch_size = M/A
    --grad-accum A          train.gradient_accumulation_steps           gradient_accumulation_steps = A
    --epochs E              train.epochs                                num_iterations
    --steps N               train.total_steps (GRPO steps)              max_steps = N*E*S/M (optimiser steps)
    --max-new-tokens        inference_model.max_new_tokens (+ eval)     max_completion_length
    --lr / --warmup-steps   optimizer.lr / optimizer.warmup_steps       ours' make_optimizer/make_scheduler passed
    --schedule              optimizer.schedule (constant, or cosine     via ``optimizers=`` (HF's built-in warm-up
    --min-lr-ratio          over --steps) / optimizer.min_lr_ratio      starts at lr 0, ours at lr/W)
    --kl-coef               train.kl_to_ref_coeff (k3, in the loss)     beta; use_bias_correction_kl=False (ours
                                                                        does not weight the KL by the ratio)
    --clip-low/--clip-high  train.clip_epsilon_low/high                 epsilon / epsilon_high
    (token mean)            train.aggregation=token_mean                loss_type="bnpo" (mean over the
                                                                        micro-batch's reply tokens, / A)
    (group advantages)      MCAdvantage: (r - mean) / std per group     scale_rewards="group"
    --top-k                 temperature 1, top_p 1,                     temperature=1, top_p=1, top_k
                            inference_model.top_k (0 = off)             (0 = off)
    --train-dtype           train_model.dtype (float32: master weights  the model's dtype; bf16=True autocasts
                            under bf16 autocast; ref/inference --dtype) when --dtype is bfloat16
    --seed                  seed                                        seed, data_seed
    grad clip 1.0, AdamW betas (0.9, 0.999), eps 1e-8, weight decay 0 on both.
Behaviour log-probs: ours keeps the sampler's log-probs from generation (no extra forward); TRL
recomputes them with a forward pass whenever the batch is reused (E > 1 or several minibatches).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Shapes for --random-init-shape: a randomly initialised Qwen2 of that size (no download needed).
RANDOM_INIT_SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
    # a CPU smoke test of the same code path: Qwen's vocabulary, a few-MB body
    "tiny-wide-vocab": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=128, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6),
}

PEAK_HOOK = '''\
import atexit, os, sys

def _bench_dump_cuda_peak():
    path, torch = os.environ.get("BENCH_CUDA_PEAK_FILE"), sys.modules.get("torch")
    if not path or torch is None:
        return
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            peak = max(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
            with open(path, "w") as f:
                f.write(str(peak))
    except Exception:
        pass

atexit.register(_bench_dump_cuda_peak)
'''


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        def _get_help_string(self, action):  # no "(default: None/False)": those helps say it themselves
            return action.help if action.default in (None, False) else super()._get_help_string(action)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    p.add_argument("--model", default="assets/tiny-model", help="local model folder")
    p.add_argument("--data", default="data/gsm8k_tiny", help="GSM8K-format data: folder of train/test.jsonl")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps (generation batches) per side")
    p.add_argument("--train-minutes", type=float, default=None,
                   help="the same clock for both: each side stops once its steps took this many minutes (ours: "
                        "train.max_minutes), evaluated there; --steps stays the cap")
    p.add_argument("--repeats", type=int, default=8, help="replies per prompt (group size)")
    p.add_argument("--prompts-per-step", type=int, default=8, help="prompts per GRPO step")
    p.add_argument("--max-new-tokens", type=int, default=24, help="reply length cap (rollouts and eval)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    p.add_argument("--warmup-steps", type=int, default=2, help="optimiser steps of linear warm-up")
    p.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                   help="after warm-up, on both sides (ours' make_scheduler): cosine decays over --steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling of rollouts on both sides (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="seed of both runs (data order, sampling, init)")
    p.add_argument("--epochs", type=int, default=2, help="passes over each generation batch")
    p.add_argument("--optim-batch-size", type=int, default=None,
                   help="samples per optimiser step (default: half the step's samples, as grpo_tiny)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimiser step")
    p.add_argument("--kl-coef", type=float, default=0.01, help="KL-to-reference coefficient (TRL's beta)")
    p.add_argument("--clip-low", type=float, default=0.2, help="ratio clipped below at 1 - this")
    p.add_argument("--clip-high", type=float, default=0.28, help="ratio clipped above at 1 + this")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where both sides train and generate")
    p.add_argument("--train-dtype", choices=["float32", "bfloat16"], default=None,
                   help="trained weights' dtype on both sides (default: --dtype); float32 with a bfloat16 --dtype: "
                        "float32 master weights under bf16 autocast, as ours' GPU configs and TRL's bf16=True train")
    p.add_argument("--ours-config", default="grpo_tiny",
                   help="ours' --config-name; the knobs above override it, the rest (e.g. dynamic sampling) stays")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="weights dtype (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="on both sides")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per side (OMP/MKL_NUM_THREADS; default: torch's default). On a CPU shared "
                        "with other work, 1 avoids the slow-down of oversubscribed OpenMP threads")
    p.add_argument("--random-init-shape", choices=sorted(RANDOM_INIT_SHAPES), default=None,
                   help="train a random-init model of this shape (with --model's tokenizer, padded to its vocab)")
    p.add_argument("--only", choices=["ours", "trl"], default=None, help="run one side only")
    p.add_argument("--recipe", choices=["tag", "flexible"], default="tag",
                   help="tag: <answer> tags, format reward 0.1 (grpo_gsm8k_tags, the tiny model's); flexible: 'The "
                        "answer is N.', the right number alone rewarded (grpo_gsm8k's default, the real models')")
    p.add_argument("--trl-vllm", choices=["off", "colocate"], default="off",
                   help="TRL generates with vLLM in its own process, on the training GPU (its colocate mode)")
    p.add_argument("--trl-vllm-memory", type=float, default=0.3,
                   help="colocate: vLLM's share of the GPU's memory (TRL's vllm_gpu_memory_utilization)")
    p.add_argument("--trl-vllm-sleep", action="store_true",
                   help="colocate: vLLM sleeps (frees its memory) while TRL trains (vllm_enable_sleep_mode)")
    p.add_argument("--ours-override", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra Hydra override for our side (repeatable), e.g. train_model.compile=true")
    p.add_argument("--eval-every", type=int, default=10, help="GRPO steps between evals (0: start and end only)")
    p.add_argument("--eval-problems", type=int, default=256, help="held-out problems per eval")
    p.add_argument("--eval-batch-size", type=int, default=128, help="prompts generated together in eval")
    p.add_argument("--out", default="bench_vs_trl.json", help="results JSON (a PNG is written next to it)")
    p.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--workdir", default=None, help="run dirs and logs (default: a temp dir, kept)")
    p.add_argument("--combine", nargs=2, metavar=("OURS_JSON", "TRL_JSON"), default=None,
                   help="merge two --only runs (e.g. one a GPU, at once) into --out, its plot and the report")
    p.add_argument("--worker", choices=["trl", "eval-checkpoint"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    return args


def build_spec(args, workdir: Path) -> dict:
    samples = args.prompts_per_step * args.repeats
    optim_bs = args.optim_batch_size or max(args.repeats, samples // 2)
    if samples % optim_bs or optim_bs % args.grad_accum:
        raise SystemExit(f"--optim-batch-size {optim_bs} must divide the step's {samples} samples and be a "
                         f"multiple of --grad-accum {args.grad_accum}")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cpu":
        dtype = "float32"  # ours runs every model in float32 on CPU whatever the config says
    model = Path(args.model)
    model = model if model.is_absolute() or model.exists() else REPO / model
    data = Path(args.data)
    data = data if data.is_absolute() or data.exists() else REPO / data
    return {
        "model": str(model.resolve()), "data": str(data.resolve()), "steps": args.steps, "repeats": args.repeats,
        "prompts_per_step": args.prompts_per_step, "samples_per_step": samples, "optim_batch_size": optim_bs,
        "grad_accum": args.grad_accum, "epochs": args.epochs,
        "optim_steps_per_grpo_step": args.epochs * samples // optim_bs,
        "max_new_tokens": args.max_new_tokens, "lr": args.lr, "warmup_steps": args.warmup_steps, "seed": args.seed,
        "schedule": args.schedule, "min_lr_ratio": args.min_lr_ratio, "top_k": args.top_k,
        "train_dtype": "float32" if args.device == "cpu" else (args.train_dtype or dtype),
        "ours_config": args.ours_config,
        "kl_coef": args.kl_coef, "clip_low": args.clip_low, "clip_high": args.clip_high, "device": args.device,
        "dtype": dtype, "gradient_checkpointing": args.gradient_checkpointing,
        "random_init_shape": args.random_init_shape, "eval_every": args.eval_every,
        "eval_problems": args.eval_problems, "eval_batch_size": args.eval_batch_size, "threads": args.threads,
        "train_minutes": args.train_minutes,
        "ours_overrides": list(args.ours_override), "trl_vllm": args.trl_vllm, "recipe": args.recipe,
        "trl_vllm_memory": args.trl_vllm_memory, "trl_vllm_sleep": args.trl_vllm_sleep,
        "workdir": str(workdir),
    }


# ------------------------------------------------------------------------------------------------
# shared pieces (run inside the worker processes)
# ------------------------------------------------------------------------------------------------
def _import_project():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tensordict import set_list_to_stack

    set_list_to_stack(True).set()


FORMAT_REWARD = {"tag": 0.1, "flexible": 0.0}  # reward.format of grpo_gsm8k_tags and grpo_gsm8k


class GreedyEvaluator:
    """The project's in-run evaluator, usable on any HF causal LM: greedy replies to the first
    ``eval_problems`` test problems through ``GSM8KTaskEnv`` and our reward; accuracy = mean success."""

    def __init__(self, spec: dict, tokenizer):
        _import_project()
        from grpo.tasks.envs import GSM8KTask, GSM8KTaskEnv, load_gsm8k

        self.num_problems = min(spec["eval_problems"], len(load_gsm8k(spec["data"], "test")))
        self.env = GSM8KTaskEnv(dataset=spec["data"], split="test", tokenizer=tokenizer, repeats=1,
                                num_envs=min(spec["eval_batch_size"], self.num_problems), seed=spec["seed"],
                                shuffle=False, answer_extraction=spec["recipe"],
                                format_reward=FORMAT_REWARD[spec["recipe"]])
        self.fields = GSM8KTask.eval_fields
        self.tokenizer = tokenizer
        self.max_new_tokens = spec["max_new_tokens"]
        self.dtype = spec["dtype"]

    def __call__(self, trained_model) -> dict:
        import torch
        from transformers import AutoModelForCausalLM

        from grpo.inference.decoding import ReplySampler
        from grpo.inference.engine import make_transformers_policy
        from grpo.loop.evaluation import evaluate
        from grpo.training.models import stop_token_ids

        was_training = trained_model.training
        trained_model.eval()
        model = trained_model
        param = next(trained_model.parameters())
        if param.dtype != _torch_dtype(self.dtype):  # float32 master weights: decode in --dtype, as ours does
            # a fresh module, not a deepcopy: TRL's accelerate wraps forward in autocast, and a copy keeps the wrapper
            with torch.device(param.device):
                model = AutoModelForCausalLM.from_config(trained_model.config, dtype=_torch_dtype(self.dtype))
            model.load_state_dict(trained_model.state_dict())
            model.generation_config = trained_model.generation_config
        # the same eager decode loop for both sides' models: equal footing, nothing to compile
        stop_ids = stop_token_ids(self.tokenizer, model.generation_config)
        sampler = ReplySampler(model, compile=False, cache_bucket=128, compact_rows=True)
        policy = make_transformers_policy(sampler, self.tokenizer,
                                          gen_kwargs={"max_new_tokens": self.max_new_tokens, "do_sample": False,
                                                      "eos_token_id": stop_ids, "pad_token_id": self.tokenizer.pad_token_id})
        t0 = time.perf_counter()
        result, _, _ = evaluate(self.env, policy, self.num_problems, self.fields)
        result["eval/time_s"] = time.perf_counter() - t0
        trained_model.train(was_training)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return result


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _load_tokenizer(spec):
    _import_project()
    from grpo.training.models import load_tokenizer

    return load_tokenizer(spec["model"])


def build_random_init_model(shape: str, tokenizer_dir: str, out_dir: Path, seed: int) -> Path:
    """A random-init Qwen2 of ``shape`` with ``tokenizer_dir``'s tokenizer, its vocabulary padded with
    unused tokens up to the model's (every id decodes, the model's vocab equals ``len(tokenizer)``)."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    dims = RANDOM_INIT_SHAPES[shape]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.save_pretrained(out_dir)
    tj_path = out_dir / "tokenizer.json"
    tj = json.loads(tj_path.read_text())
    vocab = tj["model"]["vocab"]
    used = set(vocab.values()) | {t["id"] for t in tj.get("added_tokens", [])}
    if max(used) + 1 > dims["vocab_size"]:
        raise SystemExit(f"tokenizer of {tokenizer_dir} has {max(used) + 1} ids > {shape}'s vocab {dims['vocab_size']}")
    # Printable ASCII is its own byte-level form, so these decode to plain text; no merge produces them.
    for i in range(max(used) + 1, dims["vocab_size"]):
        vocab[f"<unused{i}>"] = i
    tj_path.write_text(json.dumps(tj, ensure_ascii=False))
    tok = AutoTokenizer.from_pretrained(out_dir)
    assert len(tok) == dims["vocab_size"], (len(tok), dims["vocab_size"])
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(**dims, max_position_embeddings=4096, rms_norm_eps=1e-6, hidden_act="silu",
                         use_sliding_window=False, attention_dropout=0.0, bos_token_id=pad,
                         eos_token_id=tok.eos_token_id, pad_token_id=pad)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = pad
    model.save_pretrained(out_dir)
    (out_dir / "RANDOM_INIT.txt").write_text(f"random-init {shape} (bench_vs_trl.py), tokenizer from {tokenizer_dir}\n")
    return out_dir


# ------------------------------------------------------------------------------------------------
# (b) TRL worker
# ------------------------------------------------------------------------------------------------
def trl_worker(spec: dict) -> None:
    _import_project()
    import torch
    from torchrl.data.llm import History
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.data_utils import apply_chat_template

    from grpo.process.setup import seed_everything
    from grpo.tasks.envs import GSM8KTaskEnv, load_gsm8k
    from grpo.tasks.rewards import GSM8KReward, reference_answer
    from grpo.training.settings import OptimizerSettings
    from grpo.training.trainer import make_optimizer, make_scheduler

    seed_everything(spec["seed"])
    out = Path(spec["workdir"]) / "trl"
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _load_tokenizer(spec)
    device = torch.device("cuda:0" if spec["device"] == "cuda" else "cpu")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=_torch_dtype(spec["train_dtype"])).to(device)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        raise SystemExit("tokenizer larger than the model's vocabulary: not supported by this benchmark")

    # Data: the recipe's GSM8K chat prompt (its system prompt + question), the tokenizer's chat template.
    system = GSM8KTaskEnv.SYSTEM_PROMPTS[spec["recipe"]]
    train = load_gsm8k(spec["data"], "train")
    train = train.map(lambda row: {"prompt": [{"role": "system", "content": system},
                                              {"role": "user", "content": row["question"]}]})
    # The prompts TRL renders must be the ones our env renders (TorchRL History + the same template).
    same_prompts = all(
        apply_chat_template({"prompt": train[i]["prompt"]}, tokenizer)["prompt"]
        == History(role=["system", "user"], content=[system, train[i]["question"]], batch_size=(2,))
        .apply_chat_template(tokenizer=tokenizer, add_generation_prompt=True) for i in range(min(32, len(train))))
    # our reward itself, so both sides are paid alike: reward.correct 1 and the recipe's reward.format
    reward_fn = GSM8KReward(tokenizer, correct_reward=1.0, format_reward=FORMAT_REWARD[spec["recipe"]],
                            answer_extraction=spec["recipe"])

    def gsm8k_reward(prompts, completions, answer, **_):
        rewards = []
        for completion, answer_field in zip(completions, answer):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            cot, text = reward_fn.extract_tags(text)
            scored = reward_fn._single_correctness_reward(reference_answer(answer_field), text, cot)
            rewards.append(float(scored["reward"]))
        return rewards

    top_k = spec["top_k"]  # ours: inference_model.top_k, the same value
    micro = spec["optim_batch_size"] // spec["grad_accum"]
    k = spec["optim_steps_per_grpo_step"]
    args = GRPOConfig(
        output_dir=str(out), seed=spec["seed"], data_seed=spec["seed"],
        num_generations=spec["repeats"], generation_batch_size=spec["samples_per_step"],
        per_device_train_batch_size=micro, gradient_accumulation_steps=spec["grad_accum"],
        num_iterations=spec["epochs"], max_steps=spec["steps"] * k,
        max_completion_length=spec["max_new_tokens"], temperature=1.0, top_p=1.0, top_k=top_k,
        learning_rate=spec["lr"], max_grad_norm=1.0, weight_decay=0.0,
        beta=spec["kl_coef"], use_bias_correction_kl=False, epsilon=spec["clip_low"],
        epsilon_high=spec["clip_high"], loss_type="bnpo", scale_rewards="group", mask_truncated_completions=False,
        # colocate keeps TRL's own defaults beside it (its sequence-mask importance sampling): what its users run
        use_vllm=spec["trl_vllm"] == "colocate", vllm_mode="colocate",
        vllm_gpu_memory_utilization=spec["trl_vllm_memory"], vllm_enable_sleep_mode=spec["trl_vllm_sleep"],
        bf16=spec["dtype"] == "bfloat16", fp16=False,
        gradient_checkpointing=spec["gradient_checkpointing"], use_cpu=spec["device"] == "cpu",
        logging_steps=k, report_to="none", save_strategy="no", disable_tqdm=True, log_level="warning",
        dataloader_num_workers=0, remove_unused_columns=False,
    )
    # ours' own optimiser and schedule (grpo.training.trainer): AdamW (fused on a GPU), linear warm-up from lr/W,
    # then constant or cosine over the same optimiser steps
    settings = OptimizerSettings(lr=spec["lr"], weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8,
                                 warmup_steps=spec["warmup_steps"], schedule=spec["schedule"],
                                 min_lr_ratio=spec["min_lr_ratio"], total_optim_steps=spec["steps"] * k)
    optimizer = make_optimizer(settings, model)
    scheduler = make_scheduler(settings, optimizer)

    evaluator = GreedyEvaluator(spec, tokenizer)
    steps, evals, trl_logs = [], [], []
    cur: dict = {}

    def timed(fn, key, after=None):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            result = fn(*a, **kw)
            cur[key] = cur.get(key, 0.0) + time.perf_counter() - t0
            if after is not None:
                after(result)
            return result
        return wrapper

    def on_generated(result):
        prompt_ids, completion_ids = result[0], result[1]
        cur["completion_tokens"] = cur.get("completion_tokens", 0) + sum(len(c) for c in completion_ids)
        cur["prompt_tokens"] = cur.get("prompt_tokens", 0) + sum(len(p) for p in prompt_ids)
        cur["samples"] = cur.get("samples", 0) + len(completion_ids)

    def on_rewards(rewards_per_func):
        cur["reward"] = float(rewards_per_func.nansum(dim=1).mean())

    class StepTimer(TrainerCallback):
        """Times whole GRPO steps (k optimiser steps sharing one generation batch); evals between steps."""

        def run_eval(self, step, model_):
            result = evaluator(model_)
            evals.append({"step": step, **{k_: float(v) for k_, v in result.items()}})
            print(f"[trl] step {step}: eval accuracy {result['eval/accuracy']:.3f}", flush=True)

        def on_train_begin(self, args_, state, control, model=None, **kw):
            self.run_eval(0, model)

        def on_step_begin(self, args_, state, control, **kw):
            if state.global_step % k == 0:
                cur.clear()
                cur["t0"] = time.perf_counter()

        def on_step_end(self, args_, state, control, model=None, **kw):
            if state.global_step % k:
                return
            step_time = time.perf_counter() - cur["t0"]
            step = state.global_step // k
            row = {"step": step, "step_time_s": step_time, **{k_: v for k_, v in cur.items() if k_ != "t0"}}
            row["response_length"] = row.get("completion_tokens", 0) / max(1, row.get("samples", 1))
            steps.append(row)
            out_of_minutes = spec["train_minutes"] and sum(r["step_time_s"] for r in steps) >= 60 * spec["train_minutes"]
            if (spec["eval_every"] and step % spec["eval_every"] == 0) or step == spec["steps"] or out_of_minutes:
                self.run_eval(step, model)
            if out_of_minutes:  # as ours ends under train.max_minutes: after the step that reached it
                control.should_training_stop = True

        def on_log(self, args_, state, control, logs=None, **kw):
            if logs:
                logs_row = {"step": state.global_step // k, **{k_: v for k_, v in logs.items()
                                                               if isinstance(v, (int, float))}}
                trl_logs.append(logs_row)

    trainer = GRPOTrainer(model=model, reward_funcs=[gsm8k_reward], args=args, train_dataset=train,
                          processing_class=tokenizer, callbacks=[StepTimer()], optimizers=(optimizer, scheduler))
    trainer._generate = timed(trainer._generate, "generate_s", on_generated)
    trainer._calculate_rewards = timed(trainer._calculate_rewards, "reward_s", on_rewards)
    trainer._generate_and_score_completions = timed(trainer._generate_and_score_completions, "gen_and_score_s")
    t0 = time.perf_counter()
    trainer.train()
    train_wall = time.perf_counter() - t0
    for row in steps:  # rollout = sampling + reward; scoring = old/ref log-probs + advantages
        row["generation_s"] = row.get("generate_s", 0.0) + row.get("reward_s", 0.0)
        row["scoring_s"] = row.get("gen_and_score_s", 0.0) - row["generation_s"]
        row["train_s"] = row["step_time_s"] - row.get("gen_and_score_s", 0.0)
        row["other_s"] = 0.0  # TRL's loop overhead inside the step window is in train_s
    for row in steps:
        last = [lg for lg in trl_logs if lg["step"] == row["step"]]
        if last:
            row["trl_log"] = last[-1]
    result = {"steps": steps, "evals": evals, "train_call_s": train_wall, "prompts_identical_to_ours": same_prompts,
              "top_k": top_k, "trl_config": {k_: getattr(args, k_) for k_ in (
                  "num_generations", "generation_batch_size", "steps_per_generation", "per_device_train_batch_size",
                  "gradient_accumulation_steps", "num_iterations", "max_steps", "beta", "epsilon", "epsilon_high",
                  "loss_type", "scale_rewards", "max_completion_length", "top_k", "bf16")}}
    (out / "result.json").write_text(json.dumps(result, indent=1, default=str))


# ------------------------------------------------------------------------------------------------
# checkpoint re-evaluation worker (our final model through the same evaluator)
# ------------------------------------------------------------------------------------------------
def eval_checkpoint_worker(spec: dict) -> None:
    _import_project()
    from transformers import AutoModelForCausalLM

    from grpo.training.checkpoint import list_checkpoints, load_checkpoint

    run_dir = Path(spec["workdir"]) / "ours"
    ckpt = list_checkpoints(run_dir / "checkpoints")[-1]
    payload = load_checkpoint(ckpt)
    tokenizer = _load_tokenizer(spec)
    device = "cuda:0" if spec["device"] == "cuda" else "cpu"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=_torch_dtype(spec["dtype"]))
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    missing, unexpected = model.load_state_dict(payload["model"], strict=False)
    assert not unexpected, unexpected
    model.to(device)
    result = GreedyEvaluator(spec, tokenizer)(model)
    result["checkpoint"] = str(ckpt)
    result["checkpoint_step"] = payload["step"]
    (run_dir / "reeval.json").write_text(json.dumps(result, indent=1))


# ------------------------------------------------------------------------------------------------
# parent: run both sides, summarise, compare
# ------------------------------------------------------------------------------------------------
def ours_command(spec: dict) -> list[str]:
    s = spec
    over = [
        f"hydra.run.dir={Path(s['workdir']) / 'ours'}", f"seed={s['seed']}", "logger=none",
        f"model.name={s['model']}", f"env.dataset={s['data']}", f"env.repeats={s['repeats']}",
        f"env.num_envs={s['samples_per_step']}", f"train.dialog_turns_per_batch={s['samples_per_step']}",
        f"train.optim_batch_size={s['optim_batch_size']}", f"train.gradient_accumulation_steps={s['grad_accum']}",
        f"train.epochs={s['epochs']}", f"train.total_steps={s['steps']}", f"train.kl_to_ref_coeff={s['kl_coef']}",
        "train.use_kl_to_ref=true", "train.kl_coef_in_loss=true", "train.entropy_coeff=0.0",
        "train.aggregation=token_mean", f"train.clip_epsilon_low={s['clip_low']}",
        f"train.clip_epsilon_high={s['clip_high']}", "train.checkpoint_frequency=0",
        f"optimizer.lr={s['lr']}", f"optimizer.warmup_steps={s['warmup_steps']}", f"optimizer.schedule={s['schedule']}",
        f"optimizer.min_lr_ratio={s['min_lr_ratio']}", f"inference_model.top_k={s['top_k']}",
        "optimizer.weight_decay=0.0", "optimizer.clip_grad_norm=1.0",
        f"reward.answer_extraction={s['recipe']}", f"reward.format={FORMAT_REWARD[s['recipe']]}",
        "env.system_prompt=null", "reward.correct=1.0",
        "inference_model.backend=transformers", f"inference_model.max_new_tokens={s['max_new_tokens']}",
        "inference_model.temperature=1.0", "inference_model.top_p=1.0",
        f"eval.frequency={s['eval_every']}", f"eval.num_problems={s['eval_problems']}",
        f"eval.batch_size={s['eval_batch_size']}", "logging.progress_bar=false",
        f"train_model.dtype={s['train_dtype']}", f"ref_model.dtype={s['dtype']}", f"inference_model.dtype={s['dtype']}",
        f"train_model.gradient_checkpointing={str(s['gradient_checkpointing']).lower()}",
        f"train.max_minutes={s['train_minutes'] if s.get('train_minutes') else 'null'}",
    ]
    return [sys.executable, "grpo/grpo.py", "--config-name", s["ours_config"], *over, *s.get("ours_overrides", [])]


def child_env(spec: dict, peak_file: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    if spec["device"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    if spec.get("threads"):
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(spec["threads"])
    hook_dir = Path(spec["workdir"]) / "_peak_hook"
    hook_dir.mkdir(exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(PEAK_HOOK)
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir), *filter(None, [env.get("PYTHONPATH")])])
    env["BENCH_CUDA_PEAK_FILE"] = str(peak_file)
    return env


def run_child(cmd: list[str], log_path: Path, env: dict, label: str) -> dict:
    """Runs ``cmd`` from the repo root with output to ``log_path``; returns wall time and peak RSS."""
    print(f"[{label}] $ {shlex.join(cmd)}\n[{label}] log: {log_path}", flush=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, rusage = os.wait4(proc.pid, 0)  # rusage of this child alone
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-40:]
        raise SystemExit(f"[{label}] failed (exit {proc.returncode}); last lines of {log_path}:\n" + "\n".join(tail))
    # Linux: ru_maxrss in KiB. The 1-minute load average tells whether other work shared the CPUs.
    return {"process_wall_s": wall, "peak_rss_mb": rusage.ru_maxrss / 1024, "cpu_user_s": rusage.ru_utime,
            "cpu_sys_s": rusage.ru_stime, "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0]}


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize(steps: list[dict], evals: list[dict], samples_per_step: int) -> dict:
    """Throughput and time split of whole GRPO steps, averaged over steps 2..N (all of them if N == 1)."""
    use = steps[1:] if len(steps) > 1 else steps

    def mean(key):
        return sum(float(s.get(key, 0.0)) for s in use) / len(use)

    step_time = mean("step_time_s")
    split = {"rollout": mean("generation_s"), "scoring": mean("scoring_s"), "train": mean("train_s"),
             "other": mean("other_s")}
    tokens = mean("completion_tokens")
    final = evals[-1] if evals else {}
    return {
        "steps": len(steps), "steps_averaged": len(use), "step_time_s": step_time,
        "samples_per_s": samples_per_step / step_time, "tokens_per_s": tokens / step_time,
        "response_length": mean("response_length"),
        "split_s": split, "split_fraction": {k: v / step_time for k, v in split.items()},
        "first_step_time_s": steps[0]["step_time_s"], "train_time_s": sum(s["step_time_s"] for s in steps),
        "eval_time_s": sum(e.get("eval/time_s", 0.0) for e in evals),
        "reward_first": steps[0].get("reward"), "reward_last5": sum(s.get("reward", 0) for s in steps[-5:]) / len(steps[-5:]),
        "accuracy_start": evals[0]["eval/accuracy"] if evals else None,
        "accuracy_final": final.get("eval/accuracy"), "accuracy_final_step": final.get("step"),
    }


def run_ours(spec: dict) -> dict:
    work = Path(spec["workdir"])
    peak_file = work / "ours_cuda_peak.txt"
    cmd = ours_command(spec)
    proc = run_child(cmd, work / "ours.log", child_env(spec, peak_file), "ours")
    rows = read_jsonl(work / "ours" / "metrics.jsonl")
    steps = [r for r in rows if "step_time_s" in r]
    for r in steps:
        r["completion_tokens"] = r["response_length"] * spec["samples_per_step"]
        r["scoring_s"] = r["reference_s"]
        r["other_s"] = r["step_time_s"] - r["generation_s"] - r["reference_s"] - r["train_s"]
    evals = [r for r in rows if "eval/accuracy" in r]
    summary = summarize(steps, evals, spec["samples_per_step"])
    # our final checkpoint through the benchmark's evaluator, in its own process
    reeval = run_child([sys.executable, __file__, "--worker", "eval-checkpoint", "--spec", str(work / "spec.json")],
                       work / "ours_reeval.log", child_env(spec, work / "reeval_peak.txt"), "ours re-eval")
    re = json.loads((work / "ours" / "reeval.json").read_text())
    summary["accuracy_final_reevaluated"] = re["eval/accuracy"]
    logged = summary["accuracy_final"]
    summary["accuracy_reeval_matches_log"] = logged is not None and abs(re["eval/accuracy"] - logged) < 1e-9
    summary["reeval_process_wall_s"] = reeval["process_wall_s"]
    return {"command": shlex.join(cmd), **proc, "peak_cuda_mb": _read_peak(peak_file), **summary,
            "per_step": steps, "evals": evals}


def run_trl(spec: dict) -> dict:
    work = Path(spec["workdir"])
    peak_file = work / "trl_cuda_peak.txt"
    cmd = [sys.executable, __file__, "--worker", "trl", "--spec", str(work / "spec.json")]
    proc = run_child(cmd, work / "trl.log", child_env(spec, peak_file), "trl")
    res = json.loads((work / "trl" / "result.json").read_text())
    summary = summarize(res["steps"], res["evals"], spec["samples_per_step"])
    extra = {k: res[k] for k in ("prompts_identical_to_ours", "top_k", "trl_config", "train_call_s")}
    return {"command": shlex.join(cmd), **proc, "peak_cuda_mb": _read_peak(peak_file), **summary, **extra,
            "per_step": res["steps"], "evals": res["evals"]}


def _read_peak(path: Path):
    return int(path.read_text()) / 2**20 if path.exists() else None


def ratios(ours: dict, trl: dict) -> dict:
    def r(a, b):
        return a / b if a is not None and b not in (None, 0) else None

    return {
        "samples_per_s": r(ours["samples_per_s"], trl["samples_per_s"]),
        "tokens_per_s": r(ours["tokens_per_s"], trl["tokens_per_s"]),
        "step_time": r(ours["step_time_s"], trl["step_time_s"]),
        **{f"{k}_time": r(ours["split_s"][k], trl["split_s"][k]) for k in ("rollout", "scoring", "train")},
        "peak_rss": r(ours["peak_rss_mb"], trl["peak_rss_mb"]),
        "peak_cuda": r(ours["peak_cuda_mb"], trl["peak_cuda_mb"]),
        "accuracy_final": r(ours["accuracy_final"], trl["accuracy_final"]),
    }


def print_report(results: dict) -> None:
    sides = [s for s in ("ours", "trl") if s in results]
    fmt = "{:<34}" + "{:>14}" * len(sides) + ("{:>14}" if len(sides) == 2 else "")
    head = [*sides, "ours/trl"] if len(sides) == 2 else sides
    print("\n" + fmt.format("", *head))
    rat = results.get("ratios", {})

    def line(label, get, key=None, spec="{:.3f}"):
        vals = [get(results[s]) for s in sides]
        cells = [spec.format(v) if isinstance(v, (int, float)) else str(v) for v in vals]
        if len(sides) == 2:
            rv = rat.get(key) if key else None
            cells.append(f"{rv:.2f}x" if rv is not None else "")
        print(fmt.format(label, *cells))

    line("samples/s (whole step)", lambda s: s["samples_per_s"], "samples_per_s", "{:.2f}")
    line("generated tokens/s (whole step)", lambda s: s["tokens_per_s"], "tokens_per_s", "{:.1f}")
    line("step time s (mean of steps 2..N)", lambda s: s["step_time_s"], "step_time")
    for k, label in (("rollout", "  rollout (sampling + reward)"), ("scoring", "  log-prob + ref scoring"),
                     ("train", "  loss fwd + backward + optim"), ("other", "  other (advantages, sync)")):
        line(label, lambda s, k=k: f"{s['split_s'][k]:.3f} ({100 * s['split_fraction'][k]:.0f}%)",
             f"{k}_time" if k != "other" else None)
    line("first step s (warm-up)", lambda s: s["first_step_time_s"])
    line("reply length (tokens)", lambda s: s["response_length"], None, "{:.1f}")
    line("peak RSS MiB", lambda s: s["peak_rss_mb"], "peak_rss", "{:.0f}")
    if any(results[s]["peak_cuda_mb"] for s in sides):
        line("peak CUDA allocated MiB", lambda s: s["peak_cuda_mb"], "peak_cuda", "{:.0f}")
    line("reward step 1 / last 5 steps", lambda s: f"{s['reward_first']:.3f} / {s['reward_last5']:.3f}")
    line("greedy accuracy start", lambda s: s["accuracy_start"])
    ends = list(dict.fromkeys(str(results[side].get("accuracy_final_step")) for side in ("ours", "trl") if side in results))
    line(f"greedy accuracy step {' / '.join(ends)}", lambda s: s["accuracy_final"], "accuracy_final")  # each side's last
    line("training time s (sum of steps)", lambda s: s["train_time_s"], None, "{:.1f}")
    line("eval time s (excluded)", lambda s: s["eval_time_s"], None, "{:.1f}")
    line("process wall s (all included)", lambda s: s["process_wall_s"], None, "{:.1f}")
    line("process CPU s (user + sys)", lambda s: s["cpu_user_s"] + s["cpu_sys_s"], None, "{:.1f}")
    line("host load avg 1 min before/after", lambda s: f"{s['loadavg_1m_before']:.1f} / {s['loadavg_1m_after']:.1f}")
    if "ours" in results:
        o = results["ours"]
        print(f"\nours: logged final eval/accuracy {o['accuracy_final']:.4f}, same evaluator on the saved checkpoint "
              f"{o['accuracy_final_reevaluated']:.4f} (match: {o['accuracy_reeval_matches_log']})")
    if "trl" in results:
        print(f"trl: prompt text identical to our env's: {results['trl']['prompts_identical_to_ours']}; "
              f"top_k={results['trl']['top_k']}")


def plot(results: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"ours": "tab:blue", "trl": "tab:orange"}
    spec = results["spec"]
    names = {"ours": "ours (sync GRPO, TorchRL)",
             "trl": "TRL GRPOTrainer" + (" + vLLM (colocate)" if spec.get("trl_vllm") == "colocate" else "")}
    for side in ("ours", "trl"):
        if side not in results:
            continue
        steps = results[side]["per_step"]
        clock, t = {0: 0.0}, 0.0
        for s in steps:
            t += s["step_time_s"]
            clock[s["step"]] = t
        axes[0].plot([clock[s["step"]] for s in steps], [s["reward"] for s in steps], color=colors[side],
                     label=names[side], alpha=0.85)
        ev = results[side]["evals"]
        axes[1].plot([clock.get(e["step"], t) for e in ev], [e["eval/accuracy"] for e in ev], marker="o",
                     color=colors[side], label=names[side])
    axes[0].set(title="reward (mean of the step's samples)", xlabel="training wall-clock s (evals excluded)")
    axes[1].set(title="held-out greedy accuracy (same evaluator)", xlabel="training wall-clock s (evals excluded)")
    sides = [s for s in ("ours", "trl") if s in results]
    bottom = [0.0] * len(sides)
    for part, color in (("rollout", "tab:green"), ("scoring", "tab:purple"), ("train", "tab:red"),
                        ("other", "tab:gray")):
        vals = [results[s]["split_s"][part] for s in sides]
        axes[2].bar(sides, vals, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    axes[2].set(title="mean GRPO step time split (s)")
    for ax in axes:
        ax.legend(fontsize=8)
    clock = f" or {spec['train_minutes']:g} training minutes" if spec.get("train_minutes") else ""
    fig.suptitle(f"{Path(spec['model']).name}{' (random init ' + spec['random_init_shape'] + ')' if spec['random_init_shape'] else ''}"
                 f", {spec['device']}, {spec['steps']} steps{clock} x {spec['prompts_per_step']} prompts x {spec['repeats']} "
                 f"replies, max {spec['max_new_tokens']} new tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.spec).read_text())
        {"trl": trl_worker, "eval-checkpoint": eval_checkpoint_worker}[args.worker](spec)
        return
    if args.combine:
        write_results(combine(*args.combine), args)
        return
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vs_trl_")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    spec = build_spec(args, workdir)
    if not Path(spec["model"]).exists() or not (Path(spec["data"]) / "train.jsonl").exists():
        raise SystemExit(f"need --model {spec['model']} and --data {spec['data']} (train.jsonl, test.jsonl)")
    if args.random_init_shape:
        t0 = time.perf_counter()
        spec["tokenizer_source"] = spec["model"]
        spec["model"] = str(build_random_init_model(args.random_init_shape, spec["model"], workdir / "random-init-model",
                                                    args.seed))
        print(f"random-init {args.random_init_shape} model in {spec['model']} ({time.perf_counter() - t0:.0f}s)")
    (workdir / "spec.json").write_text(json.dumps(spec, indent=1))
    results = {"spec": spec, "argv": sys.argv, "host": {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]}}
    if args.only in (None, "ours"):
        results["ours"] = run_ours(spec)
    if args.only in (None, "trl"):
        results["trl"] = run_trl(spec)
    if "ours" in results and "trl" in results:
        results["ratios"] = ratios(results["ours"], results["trl"])
    write_results(results, args)
    print(f"run dirs and logs: {workdir}")


TRL_ONLY = ("trl_vllm", "trl_vllm_memory", "trl_vllm_sleep")  # spec keys that act on TRL's side alone


def combine(ours_json: str, trl_json: str) -> dict:
    """One result from an ``--only ours`` and an ``--only trl`` run of the same knobs (e.g. two GPUs at once)."""
    ours, trl = (json.loads(Path(f).read_text()) for f in (ours_json, trl_json))
    if "ours" not in ours or "trl" not in trl:
        raise SystemExit(f"--combine wants an --only ours result ({ours_json}) and an --only trl one ({trl_json})")
    # paths differ between run dirs; the trl_* knobs act on TRL's side only, ours_* on ours' only
    skip = {"workdir", "model", "data", "tokenizer_source", *TRL_ONLY, "ours_overrides", "ours_config"}
    differ = sorted(k for k in ours["spec"].keys() | trl["spec"].keys()
                    if k not in skip and ours["spec"].get(k) != trl["spec"].get(k))
    if differ:
        raise SystemExit(f"--combine: the two runs' knobs differ in {', '.join(differ)}: run both with the same flags")
    spec = {**ours["spec"], **{k: trl["spec"][k] for k in TRL_ONLY}}
    results = {"spec": spec, "argv": {"ours": ours["argv"], "trl": trl["argv"]},
               "host": ours["host"], "ours": ours["ours"], "trl": trl["trl"]}
    results["ratios"] = ratios(results["ours"], results["trl"])
    return results


def write_results(results: dict, args) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(results, png)
    print_report(results)
    print(f"\nresults: {out}\nplot: {png}")


if __name__ == "__main__":
    main()
