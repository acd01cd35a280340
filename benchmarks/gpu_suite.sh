#!/usr/bin/env bash
# The GPU measurements quoted in docs and closing notes, in one pass on a 2-GPU machine
# (the lent nvidia-h200-x2; no vLLM there, so generation uses transformers):
#   1. tiny config, sync, one GPU (all three models colocated)
#   2. tiny config, sync, train on GPU 0 / generation on GPU 1
#   3. sync vs async on a random-init Qwen2.5-0.5B-shaped model, train GPU 0 / generation GPU 1
#   4. the training model split over both GPUs (device_map), generation colocated (sync)
# (this project vs TRL on GPU: benchmarks/bench_vs_trl.py --device cuda --random-init-shape qwen2.5-0.5b)
# Usage: OUT=/some/dir bash benchmarks/gpu_suite.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L
common=(eval.frequency=0 eval.num_problems=128 logging.progress_bar=false logger=none allow_cpu=false)
big=(train_model.dtype=bfloat16 ref_model.dtype=bfloat16 inference_model.dtype=bfloat16
     inference_model.max_new_tokens=128 train.optim_batch_size=16)

summary() {  # the allocation table and the mean step split of a run dir
  python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
steps = [r for r in rows if "reward" in r][1:]  # first step is warm-up
keys = ["step_time_s", "generation_s", "reference_s", "train_s", "weight_sync_s", "response_length", "reward"]
print({k: round(sum(r[k] for r in steps) / len(steps), 4) for k in keys if all(k in r for r in steps)})
print([(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r])
PY
}

run_grpo() {  # name, overrides...
  local name=$1; shift
  timeout 180 python3 grpo/grpo.py --config-name grpo_tiny "${common[@]}" "hydra.run.dir=$OUT/$name" "$@" \
    > "$OUT/$name.log" 2>&1 || { echo "$name FAILED"; tail -20 "$OUT/$name.log"; return; }
  echo "== $name"; grep -A4 "^Device allocation" "$OUT/$name.log"; summary "$OUT/$name"
}

CUDA_VISIBLE_DEVICES=0 run_grpo sync_1gpu train.total_steps=6
run_grpo sync_2gpu train.total_steps=6 "train_model.devices=[0]" "inference_model.devices=[1]"

python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from bench_vs_trl import build_random_init_model
build_random_init_model('qwen2.5-0.5b', 'assets/tiny-model', Path('/tmp/q05'), seed=0)"
echo "== sync vs async, 0.5B shape"
timeout 240 python3 benchmarks/bench_sync_async.py --steps 8 --out "$OUT/sync_async.json" -- model.name=/tmp/q05 \
  "${common[@]}" "${big[@]}" "train_model.devices=[0]" "inference_model.devices=[1]" 2>&1 | tail -12
run_grpo sharded_train train.total_steps=3 model.name=/tmp/q05 "${big[@]}" train_model.num_devices=2 \
  inference_model.colocate=true ref_model.colocate=true
