"""The steps both tiny-model builders share (``scripts/build_tiny_model.py``,
``scripts/build_tiny_tools_model.py``): their common command line, the seeded
CPU set-up, the data splits, saving model + tokenizer, evaluating what was
saved and ``build_info.json``.

Nothing here imports torch or transformers before :func:`start` has run.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["build_info", "count_parameters", "evaluate_saved", "finish", "parser", "save", "splits", "start"]


def parser(doc: str, *, out: Path, data_dir: Path, seed: int, seed_help: str | None = None, vocab_size: int,
           steps: int, lr: float, threads: int) -> argparse.ArgumentParser:
    """The options every builder has (the defaults that differ between them as arguments); the builder adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(out))
    ap.add_argument("--data-dir", default=str(data_dir))
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-test", type=int, default=256)
    ap.add_argument("--seed", type=int, default=seed, help=seed_help)
    ap.add_argument("--vocab-size", type=int, default=vocab_size)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--threads", type=int, default=threads)
    ap.add_argument("--skip-eval", action="store_true")
    return ap


def start(threads: int, seed: int) -> float:
    """Quiet transformers, ``threads`` torch threads, torch seeded with ``seed``; returns the start time."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return time.time()


def splits(data, args) -> tuple[list[dict], list[dict]]:
    """Write the train and test splits of the data module ``data`` (its ``write_splits``) to ``--data-dir``, read
    them back."""
    train_path, test_path = data.write_splits(args.data_dir, args.n_train, args.n_test, args.seed)
    train = data.read_jsonl(train_path)
    test = data.read_jsonl(test_path)
    print(f"data: {len(train)} train -> {train_path}, {len(test)} test -> {test_path}")
    return train, test


def count_parameters(model, layers: int) -> int:
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2 {layers} layers, {n_params} parameters")
    return n_params


def save(model, tok, out: str | Path) -> int:
    """Save model + tokenizer to ``out``; returns the size of the safetensors."""
    from tools.tiny_model import model_file_size

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    for f in out.iterdir():  # safetensors writes its file 0600: readable by all like the other files
        if f.is_file():
            f.chmod(0o644)
    size = model_file_size(out)
    print(f"saved to {out}: safetensors {size / 1e6:.2f} MB")
    return size


def build_info(args, *, train, test, tok, n_params: int, size: int, losses: list[float], sft_seconds: float,
               after: dict[str, dict] | None = None) -> dict:
    """What ``build_info.json`` records of every build; ``after[key]``: a builder's own entries, placed after
    ``key``."""
    import torch
    import transformers

    common = {
        "seed": args.seed,
        "n_train": len(train),
        "n_test": len(test),
        "vocab_size": len(tok),
        "num_layers": args.layers,
        "n_params": n_params,
        "safetensors_bytes": size,
        "sft_steps": args.steps,
        "sft_batch_size": args.batch_size,
        "sft_lr": args.lr,
        "sft_seconds": round(sft_seconds, 1),
        "sft_final_loss": round(losses[-1], 4),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    info = {}
    for key, value in common.items():
        info[key] = value
        info.update((after or {}).get(key, {}))
    return info


def evaluate_saved(out: str | Path, info: dict, evaluate: Callable[..., dict]) -> dict:
    """Evaluate what was saved, loaded back the way users load it: ``evaluate(model, tok)`` returns the results,
    which go into ``info`` after ``eval_seconds``."""
    from tools.tiny_model import load_model, load_tokenizer

    model, tok = load_model(out), load_tokenizer(out)
    t0 = time.time()
    results = evaluate(model, tok)
    info["eval_seconds"] = round(time.time() - t0, 1)
    info.update(results)
    return results


def finish(info: dict, out: str | Path, t_start: float) -> dict:
    """Write ``info`` (with the total time) to ``out/build_info.json``."""
    info["total_seconds"] = round(time.time() - t_start, 1)
    with open(Path(out) / "build_info.json", "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    print(f"total {info['total_seconds']:.0f}s")
    return info
