#!/usr/bin/env bash
# A real model and a detached run on the lent GPU machine (the `device` tool's `run`). A call carries at most 64 MiB
# of ignored files; only what lies outside the checkout ($KEEP) outlives a call, while the machine stays warm (30 s
# after each call); and a call's processes end with it unless detached from it (a plain `nohup ... &` did not
# survive: a whole start's device minutes lost, 2026-12-02). So a model goes in pieces, one a call, back to back:
#
#   here, once:  bash scripts/device_kit.sh pack qwen2.5-coder-1.5b   # .device/<model>/: 48 MB pieces, tokenizer
#                WITH_RAY=0 bash ../shared/device/wheelhouse.sh       # .whl: the wheels the GPU machine lacks
#   there, a call each (carry what each names):
#     bash scripts/device_kit.sh setup                     # carry .whl; installs into $KEEP/site (~15 s)
#     bash scripts/device_kit.sh receive                   # carry .device/<model>/gguf.NN, one piece a call (~5 s)
#     bash scripts/device_kit.sh convert qwen2.5-coder-1.5b  # carry the last piece, .device/<model>/tok and
#                                                          # data/gsm8k_real: joined, sha256 checked, converted (~40 s)
#     bash scripts/device_kit.sh start NAME --config-name grpo_qwen15b seed=0   # detached; model and data filled in
#     bash scripts/device_kit.sh wait NAME 540             # until it ends or 540 s pass; its log and metrics to $OUT
#
# The 0.5B is 11 pieces, the 1.5B 24: setup to a running job in ~3 and ~5 device minutes. SCRIPT=grpo/grpo-async.py
# starts the async script; PYSPY=1 records the run with py-spy (add its wheel to .whl: pip download py-spy) to
# $OUT/NAME/prof.gz at `wait`.
set -uo pipefail
KEEP=${KEEP:-/root/keep}
PIECE_BYTES=48000000  # a piece, the checkout (~10 MB) and this script within a call's 64 MiB
mkdir -p "$KEEP"
export PYTHONPATH="$KEEP/site${PYTHONPATH:+:$PYTHONPATH}" PATH="$KEEP/site/bin:$PATH" PYTHONUNBUFFERED=1 \
       HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
command=${1:-}; shift || true

keep_pieces() {
  local piece
  for piece in .device/*/gguf.*; do [ -e "$piece" ] && [ ! -e "$KEEP/${piece##*/}" ] && cp "$piece" "$KEEP/"; done; true
}
case $command in
pack)  # here: the fetched model's GGUF in pieces, and its converted folder's files but the weights
  model=$1 out=.device/$1
  gguf=.cache/real-assets/$model-instruct.gguf folder=assets/$model-instruct
  [ -f "$gguf" ] && [ -d "$folder" ] || { echo "no $gguf or $folder: python scripts/fetch_real_assets.py --models $model"; exit 2; }
  rm -rf "$out" && mkdir -p "$out/tok"
  split -b $PIECE_BYTES -d "$gguf" "$out/gguf."
  find "$folder" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$out/tok/" \;
  ls "$out" | grep -c '^gguf\.' | xargs -I{} echo "$out: {} pieces (carry one a call), tok/ (carry with the last)" ;;
setup)  # there: the carried wheels installed where later calls find them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$KEEP/site" .whl/*.whl
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader; df -h "$KEEP" | tail -1
  python3 -c "import torch, transformers, torchrl; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'torchrl', torchrl.__version__)" ;;
receive)  # there: the pieces this call carried (and any earlier ones still in the checkout) kept
  keep_pieces
  echo "pieces kept: $(ls "$KEEP" | grep -c '^gguf\.')" ;;
convert)  # there: the pieces joined, checked and converted into $KEEP/assets; the real GSM8K rows beside them
  model=$1
  keep_pieces
  # joined once: a conversion that failed is tried again from the joined file, not from pieces carried again
  if ls "$KEEP"/gguf.* >/dev/null 2>&1; then cat "$KEEP"/gguf.* > "$KEEP/$model.gguf" && rm -f "$KEEP"/gguf.*; fi
  [ -f "$KEEP/$model.gguf" ] || { echo "no pieces in $KEEP: receive them first"; exit 1; }
  python3 scripts/fetch_real_assets.py --models "$model" --gguf "$KEEP/$model.gguf" --tokenizer-from ".device/$model/tok" \
    --model-only --assets "$KEEP/assets" || exit 1
  rm -f "$KEEP/$model.gguf"
  rm -rf "$KEEP/gsm8k_real" && cp -r data/gsm8k_real "$KEEP/gsm8k_real"
  ls "$KEEP/assets"; df -h "$KEEP" | tail -1 ;;
start)  # there: a run detached from this call (setsid, stdin closed), its model and data in $KEEP unless given
  name=$1; shift
  args=("$@")
  shopt -s nullglob; models=("$KEEP"/assets/*/); shopt -u nullglob
  [[ " ${args[*]} " == *" model.name="* ]] || [ ${#models[@]} -ne 1 ] || args+=("model.name=${models[0]%/}")
  [[ " ${args[*]} " == *" env.dataset="* ]] || args+=("env.dataset=$KEEP/gsm8k_real")
  mkdir -p "$KEEP/runs" && rm -rf "$KEEP/runs/$name" "$KEEP/runs/$name.log"
  run=(python3 "${SCRIPT:-grpo/grpo.py}" "${args[@]}" logger=none logging.progress_bar=false "hydra.run.dir=$KEEP/runs/$name")
  [ "${PYSPY:-0}" = 1 ] && run=(py-spy record -r 20 --nonblocking -f raw -o "$KEEP/runs/$name.prof" -- "${run[@]}")
  setsid nohup "${run[@]}" > "$KEEP/runs/$name.log" 2>&1 < /dev/null &
  echo $! > "$KEEP/runs/$name.pid"
  sleep 30; tail -4 "$KEEP/runs/$name.log" ;;
wait)  # there: until the run ends or SECONDS pass; what it wrote so far comes back under $OUT/NAME
  name=$1 seconds=$2 t0=$(date +%s)
  while kill -0 "$(cat "$KEEP/runs/$name.pid")" 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "$seconds" ]; do sleep 5; done
  kill -0 "$(cat "$KEEP/runs/$name.pid")" 2>/dev/null && echo "== $name running" || echo "== $name ended"
  grep -E "eval accuracy|^run |rror" "$KEEP/runs/$name.log" | tail -8
  mkdir -p "${OUT:?}/$name"
  cp "$KEEP/runs/$name.log" "$OUT/$name/"; cp "$KEEP/runs/$name/metrics.jsonl" "$OUT/$name/" 2>/dev/null
  [ -f "$KEEP/runs/$name.prof" ] && gzip -c "$KEEP/runs/$name.prof" > "$OUT/$name/prof.gz"; true ;;
*)
  sed -n '2,19p' "$0"; exit 2 ;;
esac
