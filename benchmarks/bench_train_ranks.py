#!/usr/bin/env python
"""The train part of a GRPO step on one rank and on N data-parallel ranks (FSDP2, ``grpo/process/world.py``),
in one invocation: seconds, the N-rank speed-up and each rank's peak memory against one rank's.

    python benchmarks/bench_train_ranks.py --ranks 2 --shape qwen2.5-1.5b           # N GPUs of one host
    python benchmarks/bench_train_ranks.py --ranks 2 --variants "" train_model.gather_dtype=bfloat16  # FSDP2 settings
    python benchmarks/bench_train_ranks.py --ranks 2 --device cpu --shape tiny-wide-vocab --replies 16 \\
        --max-new-tokens 32 --lengths real                                           # gloo, a smoke run

A random-init model of a bench_vs_trl shape is built once; each world size then runs under torchrun, where
every rank loads it as the run does (``load_policy_model``, default ``grpo_gsm8k`` config), builds the
``Trainer`` (which shards the policy over the ranks) and calls its step's ``optimize`` on the same synthetic
128-reply batch (``bench_train_step.synthetic_batch``): one warm-up call, then ``--repeats`` timed ones.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="the data-parallel world to compare with one rank")
    p.add_argument("--shape", default="qwen2.5-1.5b", help="a bench_vs_trl random-init shape")
    p.add_argument("--tokenizer", default="assets/tiny-model", help="tokenizer folder for the random-init model")
    p.add_argument("--device", default="cuda", help="cuda (one GPU a rank, NCCL) or cpu (gloo)")
    p.add_argument("--replies", type=int, default=128, help="replies in the step (train.dialog_turns_per_batch)")
    p.add_argument("--group", type=int, default=8, help="replies per prompt (env.repeats)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="reply length cap")
    p.add_argument("--lengths", default="cap", help="reply lengths: cap (all at the cap) or real (spread)")
    p.add_argument("--repeats", type=int, default=2, help="timed optimize calls")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", nargs="*", default=[""], help="N-rank runs to compare with one rank, each a "
                   "comma-separated list of Hydra overrides ('' = the default config), e.g. "
                   "train_model.gather_dtype=bfloat16,train_model.reshard_after_forward=false")
    p.add_argument("--overrides", default="", help=argparse.SUPPRESS)  # set by the driver: one variant's overrides
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)  # set by the driver for its torchrun ranks
    return p.parse_args(argv)


def rank_main(args) -> None:
    """One rank under torchrun: the trainer as the run builds it, timed on the synthetic batch."""
    import torch
    from hydra import compose, initialize_config_dir

    from bench_train_step import synthetic_batch
    from grpo.process.world import World
    from grpo.training.logprobs import ReplyLogProbs, score_replies
    from grpo.training.models import load_policy_model, load_tokenizer
    from grpo.training.settings import ModelSettings
    from grpo.training.step import GRPOSettings
    from grpo.training.trainer import Trainer, TrainerSettings

    if args.device == "cpu":
        torch.set_num_threads(1)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":  # torchrun's convention, GPU LOCAL_RANK: FSDP2 shards onto the current GPU
        torch.cuda.set_device(device)
    world = World.from_env()
    with initialize_config_dir(str(REPO / "config"), version_base=None):
        cfg = compose("grpo_gsm8k", [f"model.name={args.model_dir}", f"inference_model.max_new_tokens={args.max_new_tokens}",
                                     f"train.dialog_turns_per_batch={args.replies}", f"env.repeats={args.group}",
                                     *filter(None, args.overrides.split(","))])
    tokenizer = load_tokenizer(args.model_dir)
    policy = load_policy_model(ModelSettings.from_config(cfg), tokenizer, device)
    batch, prompt_len, reply_len = synthetic_batch(len(tokenizer), args, args.lengths, tokenizer.pad_token_id)
    with torch.no_grad():  # on-policy: the sampler's log-probs are the policy's own, scored before it is sharded
        batch["behaviour_log_probs"] = score_replies(batch, ReplyLogProbs(policy), GRPOSettings.from_config(cfg)).float()
    trainer = Trainer(TrainerSettings.from_config(cfg), policy, None, pad_token_id=tokenizer.pad_token_id, world=world)
    times = []
    for call in range(1 + args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        metrics = trainer.grpo_step.optimize(batch.clone())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if call:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else float("nan")
    peaks = world.sum(torch.zeros(world.size).index_fill_(0, torch.tensor(world.rank), peak))
    if world.is_main:
        print(json.dumps({"ranks": world.size, "train_s": min(times), "peak_gb_per_rank": peaks.tolist(),
                          "micro_batches": metrics["micro_batches"], "loss": metrics["loss_objective"],
                          "tokens": int((prompt_len + reply_len).sum())}), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.model_dir:
        return rank_main(args)
    from bench_vs_trl import build_random_init_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_init_model(args.shape, str(REPO / args.tokenizer), Path(tmp) / args.shape, args.seed)

        def timed(ranks: int, overrides: str) -> dict:
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                   f"--master_port={free_port()}", __file__, *forwarded(argv), f"--model-dir={model_dir}",
                   f"--overrides={overrides}"]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{ranks} rank(s), overrides {overrides!r} failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1]) | {"overrides": overrides}
            print(json.dumps(result), flush=True)
            return result

        one = timed(1, "")
        for variant in args.variants:
            many = timed(args.ranks, variant)
            print(json.dumps({"shape": args.shape, "replies": args.replies, "lengths": args.lengths,
                              "overrides": variant, f"speedup_{args.ranks}_ranks": one["train_s"] / many["train_s"],
                              "peak_per_rank_vs_one_rank": max(many["peak_gb_per_rank"]) / one["peak_gb_per_rank"][0],
                              "loss_relative_gap": abs(many["loss"] - one["loss"]) / max(1e-12, abs(one["loss"]))}))


def forwarded(argv) -> list[str]:
    """The driver's arguments as its ranks get them: all but the variants, which the driver hands out."""
    args, skip = [], False
    for arg in argv if argv is not None else sys.argv[1:]:
        if arg == "--variants":
            skip = True
        elif arg.startswith("--"):
            skip = False
        if not skip and not arg.startswith("--variants="):
            args.append(arg)
    return args


if __name__ == "__main__":
    main()
