#!/usr/bin/env python
"""Build the tiny tool-use model and its large-number arithmetic data set.

Seeded and CPU-only. Steps:

1. write ``data/tools_tiny/{train,test}.jsonl`` (:func:`tools.synthetic_tools.write_splits`);
2. train a small byte-level BPE tokenizer on rendered prompts (system prompt +
   the Python tool's ``# Tools`` block + question) and episodes, with the six
   tags ``<tool_call>`` ... ``</answer>`` as single non-special tokens and the
   tool chat template (:data:`tools.tiny_tools.CHAT_TEMPLATE`);
3. build a random-init ``Qwen2ForCausalLM`` (hidden 128, 3 layers, 4 heads of
   32, no grouped KV heads, MLP 256, RoPE base 1000: :func:`tools.tiny_tools.build_model`);
4. SFT it on fresh problems (their own stream, test expressions left out):
   85 % tool episodes (call ``print(a op b)``, read the result, copy it into
   ``<answer>``), 15 % direct episodes (a wrong ``<answer>`` at once), the
   loss on the first assistant token (the decision ``<tool_call>`` vs
   ``<answer>``) kept on just enough tool episodes that it is ``<tool_call>``
   in 30 % of the decisions trained (:func:`tools.tiny_tools.sft_examples`):
   the copying is learnt from many examples, yet sampling calls the tool in
   about 30 % of the episodes and greedy decoding answers directly (and
   wrongly), which leaves a GRPO run clear headroom;
5. save model + tokenizer to ``assets/tiny-tools-model`` and, from the saved
   files, simulate episodes on the test split (turn 1 stops on
   ``</tool_call>`` or ``<|im_end|>``; a call is run with a plain ``eval`` of
   its ``print`` argument, this is a measurement only; turn 2 follows the tool
   turn) and report the call rate and accuracy, sampled (T=1), greedy and with
   a forced ``<tool_call>`` opening.

Usage::

    python scripts/build_tiny_tools_model.py            # ~5 minutes on 2 idle cores
    python scripts/build_tiny_tools_model.py --skip-eval
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

_ARITH_RE = re.compile(r"print\(([0-9+\-* ()]{1,80})\)")


def run_code(code: str) -> str:
    """What ``code`` prints, for the measurement only: ``print(<arithmetic>)`` is
    evaluated with a plain ``eval`` (digits, + - * and parentheses only); any
    other code gets an error message. The product runs calls in a sandbox."""
    m = _ARITH_RE.fullmatch(code.strip())
    if m is None:
        return "Error: unsupported code\n"
    try:
        return f"{eval(m.group(1), {'__builtins__': {}}, {})}\n"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}\n"


def _generate(model, tok, contexts, *, stop_ids, max_new_tokens, temperature):
    """Continue each id list in ``contexts``; returns the new ids, cut after the first stop id."""
    import torch

    enc = tok.pad({"input_ids": contexts}, padding=True, return_tensors="pt", padding_side="left")
    kw = {"max_new_tokens": max_new_tokens, "eos_token_id": list(stop_ids), "pad_token_id": tok.pad_token_id}
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kw.update(do_sample=False)
    with torch.no_grad():
        out = model.generate(**enc, **kw)
    rows = []
    for row in out[:, enc["input_ids"].shape[1] :].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stop_ids), len(row))
        rows.append([t for t in row[:cut] if t != tok.pad_token_id])
    return rows


def simulate(model, tok, problems, *, temperature=1.0, force_call=False, seed=0, batch_size=64,
             max_turn1=48, max_turn2=20, return_records=False) -> dict:
    """Play one episode per problem (turn 1, the tool if called, turn 2) and score it.

    Returns rates over the episodes: ``call_rate`` (turn 1 ended on
    ``</tool_call>``), ``call_ok_rate`` (and the call is well-formed JSON, name
    python, code ``print(<the problem's expression>)``), ``accuracy`` (the
    final ``<answer>`` is the result), ``copy_accuracy`` (accuracy among the
    episodes with a correct call), ``direct_accuracy`` (accuracy among the
    episodes without a call) and ``examples`` (a few decoded episodes).
    """
    import torch

    from tools import synthetic_tools as st
    from tools import tiny_tools as tt
    from tools.tiny_model import extract_answer

    call_open = tok.convert_tokens_to_ids(tt.CALL_OPEN)
    call_close = tok.convert_tokens_to_ids(tt.CALL_CLOSE)
    eos = tok.eos_token_id
    torch.manual_seed(seed)
    recs = []
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompts = [tok(tt.build_prompt(tok, p["question"]), add_special_tokens=False)["input_ids"] for p in chunk]
        prefill = [call_open] if force_call else []
        turn1 = _generate(model, tok, [q + prefill for q in prompts], stop_ids=(call_close, eos),
                          max_new_tokens=max_turn1, temperature=temperature)
        turn1 = [prefill + t for t in turn1]
        pending = []
        for i, (p, q, t1) in enumerate(zip(chunk, prompts, turn1)):
            text1 = tok.decode(t1)
            rec = {"turn1": text1, "called": bool(t1) and t1[-1] == call_close}
            rec["call_ok"] = rec["called"] and tt.tool_call_expression(text1) == st.expression(p)
            if rec["called"]:
                call = tt.parse_tool_call(text1)
                code = (call or {}).get("arguments", {}).get("code", "") if isinstance((call or {}).get("arguments"), dict) else ""
                rec["tool"] = run_code(code if isinstance(code, str) else "")
                ctx = q + t1 + tok(tt.tool_turn_text(tok, rec["tool"]), add_special_tokens=False)["input_ids"]
                pending.append((i, ctx))
            recs.append(rec)
        if pending:
            turn2 = _generate(model, tok, [c for _, c in pending], stop_ids=(eos,), max_new_tokens=max_turn2,
                              temperature=temperature)
            for (i, _), t2 in zip(pending, turn2):
                recs[start + i]["turn2"] = tok.decode(t2)
        for p, rec in zip(chunk, recs[start:]):
            final = rec.get("turn2", rec["turn1"]) if rec["called"] else rec["turn1"]
            gold = p["answer"].split("#### ")[-1].strip()
            rec["correct"] = extract_answer(final) == gold
    n = max(1, len(recs))
    ok = [r for r in recs if r["call_ok"]]
    extra = {"records": recs} if return_records else {}
    direct = [r for r in recs if not r["called"]]
    return {
        "n": len(recs),
        "call_rate": sum(r["called"] for r in recs) / n,
        "call_ok_rate": len(ok) / n,
        "accuracy": sum(r["correct"] for r in recs) / n,
        "copy_accuracy": sum(r["correct"] for r in ok) / len(ok) if ok else None,
        "direct_accuracy": sum(r["correct"] for r in direct) / len(direct) if direct else None,
        "n_direct": len(direct),
        "examples": [{k: v for k, v in r.items()} for r in recs[:3]],
        **extra,
    }


def _fmt(name: str, r: dict) -> str:
    def f(x):
        return "  -  " if x is None else f"{x:.3f}"

    return (f"{name:<22} call {f(r['call_rate'])}  call ok {f(r['call_ok_rate'])}  accuracy {f(r['accuracy'])}  "
            f"copy-acc | ok call {f(r['copy_accuracy'])}  acc | no call {f(r['direct_accuracy'])} (n={r['n_direct']})")


def main(argv: list[str] | None = None) -> dict:
    from tools import tiny_build as tb

    # Seed 1: whether SFT learns to copy digits reliably depends on the seed (on 2 cores, 800 steps: seed 1
    # copies the tool result right in 99.6 % of greedy episodes, seeds 0 and 2 in 75 %; see tiny_tools.build_model).
    # One thread: the float sums, hence the weights built, then do not depend on the number of cores.
    ap = tb.parser(__doc__, out=REPO_ROOT / "assets" / "tiny-tools-model", data_dir=REPO_ROOT / "data" / "tools_tiny",
                   seed=1, seed_help="seed of the data splits", vocab_size=640, steps=800, lr=1e-3, threads=1)
    ap.add_argument("--init-seed", type=int, default=None,
                    help="seed of the initial weights, the SFT problems and their order (default: --seed)")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=256)
    ap.add_argument("--rope-theta", type=float, default=1000.0)
    ap.add_argument("--sft-problems", type=int, default=24000,
                    help="fresh problems for SFT (a stream of their own, test expressions left out)")
    ap.add_argument("--tool-rows", type=float, default=0.85, help="fraction of SFT episodes that call the tool")
    ap.add_argument("--call-frac", type=float, default=0.3,
                    help="fraction of the trained decision tokens (first assistant token) that are <tool_call>")
    args = ap.parse_args(argv)
    init_seed = args.seed if args.init_seed is None else args.init_seed
    t_start = tb.start(args.threads, init_seed)

    from tools import synthetic_tools as st
    from tools import tiny_model as tm
    from tools import tiny_tools as tt

    train, test = tb.splits(st, args)
    tok = tt.build_tokenizer(train, vocab_size=args.vocab_size)
    print(f"tokenizer: {len(tok)} tokens; tags " + ", ".join(f"{t}={tok.convert_tokens_to_ids(t)}" for t in tt.TAG_TOKENS)
          + f", {tt.IM_END}={tok.eos_token_id}")
    model = tt.build_model(tok, num_layers=args.layers, num_kv_heads=args.kv_heads,
                           intermediate_size=args.intermediate, rope_theta=args.rope_theta, seed=init_seed)
    n_params = tb.count_parameters(model, args.layers)

    test_exprs = {st.expression(p) for p in test}
    sft_problems = [p for p in st.make_problems(args.sft_problems, f"sft-{init_seed}") if st.expression(p) not in test_exprs]
    t0 = time.time()
    examples, counts = tt.sft_examples(tok, sft_problems, tool_rows=args.tool_rows, call_frac=args.call_frac,
                                       seed=init_seed)
    lengths = [len(ids) for ids, _ in examples]
    print(f"sft data: {counts} ({min(lengths)}-{max(lengths)} tokens, {time.time() - t0:.0f}s); a tool episode:")
    example = tt.episode_pieces(tok, test[0], "tool")
    print("".join(t for t, _ in example))
    t0 = time.time()
    losses = tm.sft_masked(model, tok, examples, steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=init_seed)
    sft_s = time.time() - t0
    print(f"sft: {args.steps} steps in {sft_s:.0f}s, final loss {losses[-1]:.4f}")

    size = tb.save(model, tok, args.out)
    info = tb.build_info(args, train=train, test=test, tok=tok, n_params=n_params, size=size, losses=losses,
                         sft_seconds=sft_s, after={
                             "seed": {"init_seed": init_seed},
                             "vocab_size": {"token_ids": {t: tok.convert_tokens_to_ids(t)
                                                          for t in tt.TAG_TOKENS + tt.SPECIAL_TOKENS}},
                             "sft_lr": {
                                 "kv_heads": args.kv_heads,
                                 "intermediate_size": args.intermediate,
                                 "rope_theta": args.rope_theta,
                                 "sft_problems": len(sft_problems),
                                 "sft_counts": counts,
                                 "sft_max_tokens": max(lengths),
                             },
                         })
    if not args.skip_eval:
        runs = tb.evaluate_saved(args.out, info, lambda model, tok: {
            "test_sampled_t1": simulate(model, tok, test, temperature=1.0, seed=args.seed),
            "test_greedy": simulate(model, tok, test, temperature=0.0),
            "test_forced_call_greedy": simulate(model, tok, test, temperature=0.0, force_call=True),
            "train_sampled_t1": simulate(model, tok, train[:256], temperature=1.0, seed=args.seed),
        })
        for name, r in runs.items():
            print(_fmt(name, r))
        print("examples (test, sampled):")
        for e in runs["test_sampled_t1"]["examples"]:
            print("  ", json.dumps(e))
    return tb.finish(info, args.out, t_start)


if __name__ == "__main__":
    main()
