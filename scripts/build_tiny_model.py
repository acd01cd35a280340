#!/usr/bin/env python
"""Build the embedded tiny model and the synthetic GSM8K-format data set.

Seeded and CPU-only. Steps:

1. write ``data/gsm8k_tiny/{train,test}.jsonl`` (:func:`grpo.synthetic.write_splits`);
2. train a small byte-level BPE tokenizer on the training split + TorchRL's
   GSM8K system prompt;
3. build a random-init ``Qwen2ForCausalLM`` (hidden 128, 3 layers, head_dim 32);
4. SFT it briefly on a style mixture (see :data:`grpo.tiny_model.DEFAULT_ANSWER_PROB`)
   so that it computes the arithmetic well but greedily uses the rewarded
   ``<answer>`` format on only part of the problems, which leaves a GRPO run
   clear and quick headroom;
5. save model + tokenizer to ``assets/tiny-model`` and report greedy accuracy,
   sampled (temperature 1) accuracy and format rate on the test split, from
   the saved files.

Usage::

    python scripts/build_tiny_model.py            # ~2-3 minutes on 2 idle cores
    python scripts/build_tiny_model.py --skip-eval
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def _parse_mix(text: str) -> dict[str, float]:
    out = {}
    for item in text.split(","):
        op, prob = item.split("=")
        out[op.strip()] = float(prob)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO_ROOT / "assets" / "tiny-model"))
    ap.add_argument("--data-dir", default=str(REPO_ROOT / "data" / "gsm8k_tiny"))
    ap.add_argument("--n-train", type=int, default=2000)
    ap.add_argument("--n-test", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=600)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--mix", default="+=0.8,-=0.3,*=0.3", help="P(<answer> style) per operation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--skip-eval", action="store_true")
    args = ap.parse_args(argv)

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    from tools import synthetic
    from tools import tiny_model as tm

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()

    train_path, test_path = synthetic.write_splits(args.data_dir, args.n_train, args.n_test, args.seed)
    train = synthetic.read_jsonl(train_path)
    test = synthetic.read_jsonl(test_path)
    print(f"data: {len(train)} train -> {train_path}, {len(test)} test -> {test_path}")

    tok = tm.build_tokenizer(train, vocab_size=args.vocab_size)
    print(f"tokenizer: {len(tok)} tokens")
    model = tm.build_model(tok, num_layers=args.layers, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2 {args.layers} layers, {n_params} parameters")

    styles = tm.assign_styles(train, _parse_mix(args.mix), seed=args.seed)
    examples = [
        (tm.build_prompt(tok, p["question"]), tm.format_response(p, style))
        for p, style in zip(train, styles)
    ]
    print(f"sft: {sum(s == 'answer' for s in styles)}/{len(styles)} targets in the <answer> style; example:")
    print(examples[0][0] + examples[0][1] + tm.IM_END)
    t0 = time.time()
    losses = tm.sft(model, tok, examples, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=args.seed, log_every=100)
    sft_s = time.time() - t0
    print(f"sft: {args.steps} steps in {sft_s:.0f}s, final loss {losses[-1]:.4f}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    size = tm.model_file_size(out)
    print(f"saved to {out}: safetensors {size / 1e6:.2f} MB")

    info = {
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
        "sft_answer_prob": _parse_mix(args.mix),
        "sft_seconds": round(sft_s, 1),
        "sft_final_loss": round(losses[-1], 4),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if not args.skip_eval:
        # Evaluate what was saved, loaded back the way users load it.
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
        tok = transformers.AutoTokenizer.from_pretrained(out)
        t0 = time.time()
        greedy = tm.evaluate_greedy(model, tok, test, args.max_new_tokens)
        sampled = tm.evaluate(model, tok, test, args.max_new_tokens, temperature=1.0, seed=args.seed)
        info["eval_seconds"] = round(time.time() - t0, 1)
        info["test_greedy"] = greedy
        info["test_sampled_t1"] = sampled
        print(
            f"test greedy : accuracy {greedy['accuracy']:.3f}  format {greedy['format_rate']:.3f}  "
            f"number-correct (any format) {greedy['number_accuracy']:.3f}"
        )
        print(
            f"test sampled (T=1): accuracy {sampled['accuracy']:.3f}  format {sampled['format_rate']:.3f}  "
            f"number-correct (any format) {sampled['number_accuracy']:.3f}"
        )
    info["total_seconds"] = round(time.time() - t_start, 1)
    with open(out / "build_info.json", "w") as f:
        json.dump(info, f, indent=2)
        f.write("\n")
    print(f"total {info['total_seconds']:.0f}s")
    return info


if __name__ == "__main__":
    main()
