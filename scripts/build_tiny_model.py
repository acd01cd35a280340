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
    from tools import tiny_build as tb

    ap = tb.parser(__doc__, out=REPO_ROOT / "assets" / "tiny-model", data_dir=REPO_ROOT / "data" / "gsm8k_tiny",
                   seed=0, vocab_size=600, steps=1000, lr=4e-3, threads=2)
    ap.add_argument("--mix", default="+=0.8,-=0.3,*=0.3", help="P(<answer> style) per operation")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    t_start = tb.start(args.threads, args.seed)

    from tools import synthetic
    from tools import tiny_model as tm

    train, test = tb.splits(synthetic, args)
    tok = tm.build_tokenizer(train, vocab_size=args.vocab_size)
    print(f"tokenizer: {len(tok)} tokens")
    model = tm.build_model(tok, num_layers=args.layers, seed=args.seed)
    n_params = tb.count_parameters(model, args.layers)

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

    size = tb.save(model, tok, args.out)
    info = tb.build_info(args, train=train, test=test, tok=tok, n_params=n_params, size=size, losses=losses,
                         sft_seconds=sft_s, after={"sft_lr": {"sft_answer_prob": _parse_mix(args.mix)}})
    if not args.skip_eval:
        results = tb.evaluate_saved(args.out, info, lambda model, tok: {
            "test_greedy": tm.evaluate_greedy(model, tok, test, args.max_new_tokens),
            "test_sampled_t1": tm.evaluate(model, tok, test, args.max_new_tokens, temperature=1.0, seed=args.seed),
        })
        for name, r in (("test greedy ", results["test_greedy"]), ("test sampled (T=1)", results["test_sampled_t1"])):
            print(f"{name}: accuracy {r['accuracy']:.3f}  format {r['format_rate']:.3f}  "
                  f"number-correct (any format) {r['number_accuracy']:.3f}")
    return tb.finish(info, args.out, t_start)


if __name__ == "__main__":
    main()
