"""Generation throughput of the two inference backends on the same prompts, in one run.

    python benchmarks/bench_inference_backends.py --model assets/tiny-model \
        --num-prompts 16 --max-new-tokens 32

Backends: transformers ``model.generate`` through TorchRL's ``TransformersWrapper``, and an
in-process vLLM engine through ``vLLMWrapper`` (grpo.inference.vllm_backend). Both sample (temperature
1.0) exactly ``--max-new-tokens`` tokens per prompt (EOS ignored / min_new_tokens), from the
same chat prompts, returning response log-probs as the GRPO collector would. Prints
tokens/s for each, the ratio, vLLM import and engine start-up time, and the time of an
in-place weight update (``push_weights``). ``--model tiny`` (the default when
assets/tiny-model is missing) builds a random 2-layer Qwen2 (4 heads of 32) in a temp dir.

transformers runs first: starting vLLM's CPU worker binds this process's OpenMP threads to
cores and turns ``torch.set_num_threads`` into a no-op, which would change a later
transformers run. On a shared CPU pass ``--threads 1`` (or run under ``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from grpo.inference.vllm_backend import (  # noqa: E402
    configure_vllm_env, make_vllm_engine, make_vllm_policy, push_weights)

_QUESTIONS = [
    "What is {a} plus {b}?",
    "Natalia sold {a} clips in April and {b} in May. How many clips did she sell?",
    "Solve step by step: {a} * {b} = ?",
    "A train travels {a} km in {b} hours. What is its average speed?",
]


def make_histories(n: int):
    from tensordict import TensorDict
    from torchrl.data.llm import History
    from torchrl.modules.llm.policies import ChatHistory

    chats = []
    for i in range(n):
        q = _QUESTIONS[i % len(_QUESTIONS)].format(a=3 + 7 * i, b=2 + i % 5)
        chats.append(
            [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": q},
            ]
        )
    return TensorDict(history=ChatHistory(prompt=History.from_chats(chats)), batch_size=(n,))


def count_response_tokens(out) -> int:
    return sum(int(t.numel()) for t in out.get(("tokens", "response"), as_list=True))


def timed_generate(policy, histories, repeats: int):
    """Warm up once on 2 prompts, then time ``repeats`` full batches.

    Returns (median seconds, best seconds, generated tokens per batch). On a shared machine
    the best batch is the steadier number; the median shows what contention costs.
    """
    policy(histories[:2])
    times, ntok = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = policy(histories)
        times.append(time.perf_counter() - t0)
        ntok = count_response_tokens(out)
    return statistics.median(times), min(times), ntok


def main(argv=None) -> dict:
    default_model = str(REPO / "assets" / "tiny-model")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=default_model, help="HF model dir or hub id")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="timed batches per backend")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--weight-updates", type=int, default=5)
    p.add_argument("--threads", type=int, default=None,
                   help="torch/OpenMP threads for both backends (default: torch's). On a "
                        "shared or oversubscribed CPU use 1: spinning OpenMP barriers made "
                        "2-thread runs 10-30x slower and erratic on a loaded 2-core machine")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # vLLM's CPU worker reads it
        torch.set_num_threads(args.threads)

    model_path = args.model
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # `import torchrl.modules.llm` imports vllm when installed: time that import on its own
    configure_vllm_env(device=device, offline=os.path.isdir(model_path))
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams  # noqa: F401  (the heavy part of `import vllm`)

    vllm_import_s = time.perf_counter() - t0

    from tensordict import set_list_to_stack
    from transformers import AutoModelForCausalLM, AutoTokenizer

    set_list_to_stack(True).set()
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(model_path)
    hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    hf_model.generation_config.min_new_tokens = args.max_new_tokens  # same length as vLLM
    n_params = sum(p.numel() for p in hf_model.parameters())
    histories = make_histories(args.num_prompts)
    gen = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0}
    res: dict = {
        "model": args.model,
        "params": n_params,
        "device": device,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "max_new_tokens": args.max_new_tokens,
    }

    # ---- transformers
    from torchrl.modules.llm import TransformersWrapper

    hf_policy = TransformersWrapper(
        hf_model,
        tokenizer=tok,
        input_mode="history",
        generate=True,
        return_log_probs=True,
        pad_output=False,
        generate_kwargs={**gen, "do_sample": True},
    )
    res["transformers_threads"] = torch.get_num_threads()
    with torch.no_grad():
        s, best, n = timed_generate(hf_policy, histories, args.repeats)
    res.update(transformers_s=s, transformers_tokens=n, transformers_tok_s=n / s,
               transformers_best_tok_s=n / best)

    # ---- vLLM
    res["vllm_import_s"] = vllm_import_s
    t0 = time.perf_counter()
    llm = make_vllm_engine(
        model_path, dtype=args.dtype, max_model_len=args.max_model_len, device=device
    )
    res["vllm_startup_s"] = time.perf_counter() - t0
    vllm_policy = make_vllm_policy(llm, tok, generate_kwargs={**gen, "ignore_eos": True})
    s, best, n = timed_generate(vllm_policy, histories, args.repeats)
    res.update(vllm_s=s, vllm_tokens=n, vllm_tok_s=n / s, vllm_best_tok_s=n / best)
    res["speedup_vllm_over_transformers"] = res["vllm_tok_s"] / res["transformers_tok_s"]
    res["speedup_best"] = res["vllm_best_tok_s"] / res["transformers_best_tok_s"]

    # ---- weight update (trainer -> engine), same weights so outputs stay valid
    upd = [push_weights(llm, hf_model.state_dict()) for _ in range(args.weight_updates)]
    res["weight_update_s"] = statistics.median(upd)
    res["weight_update_mb"] = sum(
        t.numel() * t.element_size() for t in hf_model.state_dict().values()
    ) / 2**20

    res["load_avg_1min"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    res["cpu_count"] = os.cpu_count()
    print()
    print(f"model {args.model}  ({n_params / 1e6:.2f} M params, {args.dtype}, {device}; "
          f"load average {res['load_avg_1min']} on {res['cpu_count']} cpus)")
    print(f"{args.num_prompts} prompts x {args.max_new_tokens} new tokens, sampled, "
          f"{args.repeats} timed batches per backend: median (best)")
    print(f"  transformers : {res['transformers_tok_s']:9.1f} ({res['transformers_best_tok_s']:.1f})"
          f" tokens/s  [{res['transformers_threads']} torch threads]")
    print(f"  vLLM         : {res['vllm_tok_s']:9.1f} ({res['vllm_best_tok_s']:.1f}) tokens/s")
    print(f"  ratio vLLM/transformers: {res['speedup_vllm_over_transformers']:.2f}x "
          f"({res['speedup_best']:.2f}x best vs best)")
    print(f"  vLLM import {res['vllm_import_s']:.1f} s, engine start-up {res['vllm_startup_s']:.1f} s")
    print(f"  weight update (push_weights, {res['weight_update_mb']:.1f} MB): "
          f"{res['weight_update_s'] * 1e3:.1f} ms (median of {args.weight_updates})")
    print(json.dumps(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
