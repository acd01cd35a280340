#!/usr/bin/env bash
# The GPU measurements quoted in docs and closing notes, on the lent 2-GPU machine (nvidia-h200-x2;
# no vLLM there, so generation uses transformers). Each part runs on its own; pick with PARTS.
#   trl       this project vs TRL's GRPOTrainer, random-init Qwen2.5-0.5B shape, one GPU (issue 10)
#   trl_compiled  the same with train_model.compile=true on our side
#   generation     rollout batches: eager decoding vs the compiled static-cache decode step, 0.5B shape
#   syncasync sync vs async, tiny config, train on GPU 0 / generation on GPU 1 (issue 4)
#   syncasync_05b  the same on a random-init Qwen2.5-0.5B shape, 64 new tokens
#   sharded   the training model over both GPUs: 2 data-parallel FSDP2 ranks (num_devices=2), 0.5B shape (issue 30)
#   job_05b, job_15b  sync vs async on the default job (grpo_gsm8k, 128 replies x 512 tokens), random-init
#             Qwen2.5-0.5B / 1.5B shapes, train GPU 0 / generation GPU 1, one optimiser step a batch,
#             one-step off-policy (train.buffer_size=0, max_policy_lag 2) (issue 28)
#   layouts   every two-GPU layout docs/devices.md documents, sync and async, compiled decode step, 0.5B shape
#             (LAYOUTS picks some of: sync_split async_split sync_colocated sync_train_both sync_all_both;
#             async_ranks, 2 trainer ranks and 2 rollout workers, needs 4 GPUs)
#   train_ranks  the train part on 1 and 2 data-parallel ranks (FSDP2), 1.5B shape, FSDP2 settings (issue 30)
#   ranks_15b the default job (grpo_gsm8k, 128 replies x 512 tokens) with both GPUs training and generating:
#             2 FSDP2 ranks, one engine each, random-init Qwen2.5-1.5B shape (issue 30)
#   cluster   needs 4 GPUs: the async script joining a Ray cluster of 2 nodes on this host (GPUs 0 | 1,2,3:
#             scripts/local_ray_cluster.py), 2 trainer ranks and 2 rollout workers placed by Ray, 0.5B shape; which
#             process held which GPU (nvidia-smi every 2 s); then the same on a local Ray for comparison (issue 30)
# Usage: OUT=/some/dir PARTS="trl syncasync" bash benchmarks/gpu_suite.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_suite}
PARTS=${PARTS:-"trl syncasync sharded"}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi -L
trl_args=(--device cuda --random-init-shape qwen2.5-0.5b --steps 10 --max-new-tokens 64 --grad-accum 4
          --eval-problems 32 --eval-every 0)

# bench_vs_trl NAME TIMEOUT [extra args]: one GPU (TRL refuses two visible), results under $OUT/NAME*
bench_vs_trl() {
  local name=$1 limit=$2; shift 2
  CUDA_VISIBLE_DEVICES=0 timeout "$limit" python3 benchmarks/bench_vs_trl.py "${trl_args[@]}" "$@" --out "$OUT/$name.json" \
    --workdir "$OUT/${name}_work" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$?"; grep -v "^\[" "$OUT/$name.log" | tail -28
}

# the default job on a random-init shape, both scripts: job SHAPE TIMEOUT. Random-init models score 0 on every reply:
# dynamic sampling is off in these speed runs, which would otherwise draw every extra generation batch it may
job() {
  timeout "$2" python3 benchmarks/bench_sync_async.py --config-name grpo_gsm8k --random-init-shape "qwen2.5-$1" --steps 5 \
    --warmup 2 --out "$OUT/job_$1.json" -- env.dataset=data/gsm8k_tiny inference_model.backend=transformers train.dynamic_sampling=false \
    "train_model.devices=[0]" "inference_model.devices=[1]" train.optim_batch_size=128 train.buffer_size=0 \
    train.max_policy_lag=2 eval.num_problems=16 eval.max_new_tokens=16 logging.export=false > "$OUT/job_$1.log" 2>&1
  echo "== job_$1 rc=$?"; grep -v "^\[" "$OUT/job_$1.log" | tail -12
}

# one layout, 3 steps of the 0.5B shape with 64 new tokens: layout NAME SCRIPT [overrides]
layout() {
  local name=$1 script=$2; shift 2
  timeout "${LAYOUT_TIMEOUT:-150}" python3 "grpo/$script" --config-name grpo_tiny train.total_steps=3 model.name=/tmp/q05 eval.frequency=0 \
    eval.num_problems=16 eval.max_new_tokens=16 logging.progress_bar=false logger=none allow_cpu=false \
    train_model.dtype=bfloat16 ref_model.dtype=bfloat16 inference_model.dtype=bfloat16 inference_model.compile=true \
    inference_model.max_new_tokens=64 train.optim_batch_size=16 "hydra.run.dir=$OUT/layout_$name" "$@" \
    > "$OUT/layout_$name.log" 2>&1
  echo "== layout $name ($script $*) rc=$?"; grep -A3 "^Devices" "$OUT/layout_$name.log"; tail -2 "$OUT/layout_$name.log"
  python3 -c "
import json, sys
rows = [json.loads(l) for l in open('$OUT/layout_$name/metrics.jsonl') if '\"step_time_s\"' in l]
print('   step_time_s', [round(r['step_time_s'], 2) for r in rows], 'generation_s', [round(r.get('generation_s', 0), 2) for r in rows],
      'pushes verified', rows[-1].get('weight_pushes_verified'))" 2>&1 | tail -2
}

# a random-init model of a bench_vs_trl shape, once: build SHAPE DIR
build() {
  [ -d "$2" ] || python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from bench_vs_trl import build_random_init_model
build_random_init_model('$1', 'assets/tiny-model', Path('$2'), seed=0)" > /dev/null
}

for part in $PARTS; do
  start=$(date +%s)
  case $part in
    trl) bench_vs_trl trl 540 ;;
    trl_compiled) bench_vs_trl trl_compiled 560 --ours-override train_model.compile=true ;;
    generation)
      CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/bench_generation.py --device cuda --shapes qwen2.5-0.5b \
        --batches 64 --max-new-tokens 512 --calls 2 --out "$OUT/generation.json" > "$OUT/generation.log" 2>&1
      echo "== generation rc=$?"; tail -4 "$OUT/generation.log" ;;
    syncasync)
      timeout 220 python3 benchmarks/bench_sync_async.py --steps 6 --warmup 1 --out "$OUT/sync_async.json" -- \
        allow_cpu=false "train_model.devices=[0]" "inference_model.devices=[1]" eval.num_problems=16 \
        > "$OUT/sync_async.log" 2>&1; echo "== syncasync rc=$?"; tail -12 "$OUT/sync_async.log" ;;
    syncasync_05b)
      timeout 300 python3 benchmarks/bench_sync_async.py --random-init-shape qwen2.5-0.5b --steps 5 --warmup 1 \
        --out "$OUT/sync_async_05b.json" -- allow_cpu=false "train_model.devices=[0]" "inference_model.devices=[1]" \
        eval.num_problems=16 train_model.dtype=bfloat16 ref_model.dtype=bfloat16 inference_model.dtype=bfloat16 \
        inference_model.max_new_tokens=64 train.gradient_accumulation_steps=4 \
        > "$OUT/sync_async_05b.log" 2>&1; echo "== syncasync_05b rc=$?"; tail -12 "$OUT/sync_async_05b.log" ;;
    job_05b) job 0.5b 330 ;;
    job_15b) job 1.5b 560 ;;
    layouts)
      build qwen2.5-0.5b /tmp/q05
      for name in ${LAYOUTS:-sync_split async_split sync_colocated sync_train_both sync_all_both}; do
        case $name in
          sync_split) layout sync_split grpo.py ;;
          async_split) layout async_split grpo-async.py ;;
          sync_colocated) layout sync_colocated grpo.py inference_model.colocate=true ;;
          sync_train_both) layout sync_train_both grpo.py train_model.num_devices=2 inference_model.colocate=true ;;
          sync_all_both) layout sync_all_both grpo.py train_model.num_devices=2 inference_model.num_devices=2 \
                           inference_model.colocate=true ;;
          async_ranks) layout async_ranks grpo-async.py train_model.num_devices=2 "inference_model.devices=[2,3]" \
                         train.num_collectors=2 ;;
        esac
      done ;;
    train_ranks)
      timeout 540 python3 benchmarks/bench_train_ranks.py --ranks 2 --shape qwen2.5-1.5b --variants "" \
        train_model.reshard_after_forward=false train_model.gather_dtype=bfloat16 \
        train_model.gather_dtype=bfloat16,train_model.reshard_after_forward=false > "$OUT/train_ranks.log" 2>&1
      echo "== train_ranks rc=$?"; grep "^{" "$OUT/train_ranks.log"; grep -v "^{" "$OUT/train_ranks.log" | tail -5 ;;
    ranks_15b)
      build qwen2.5-1.5b /tmp/q15
      timeout 420 python3 grpo/grpo.py train.total_steps=4 model.name=/tmp/q15 env.dataset=data/gsm8k_tiny \
        inference_model.backend=transformers train.dynamic_sampling=false train_model.num_devices=2 inference_model.num_devices=2 \
        inference_model.colocate=true eval.frequency=0 eval.num_problems=16 eval.max_new_tokens=16 logger=none \
        logging.progress_bar=false logging.export=false "hydra.run.dir=$OUT/ranks_15b" \
        > "$OUT/ranks_15b.log" 2>&1
      echo "== ranks_15b rc=$?"; grep -A4 "^Devices" "$OUT/ranks_15b.log"; tail -3 "$OUT/ranks_15b.log"
      python3 -c "
import json
rows = [json.loads(l) for l in open('$OUT/ranks_15b/metrics.jsonl') if '\"step_time_s\"' in l]
for r in rows: print('   ', {k: round(v, 2) for k, v in r.items() if k.endswith('_s') or 'memory' in k})" 2>&1 | tail -5
      rm -rf "$OUT/ranks_15b/checkpoints" ;;
    cluster)
      build qwen2.5-0.5b /tmp/q05
      rm -f "$OUT/ray_address"
      python3 scripts/local_ray_cluster.py --nodes 0 1,2,3 --address-file "$OUT/ray_address" > "$OUT/cluster_ray.log" 2>&1 &
      cluster_pid=$!
      for _ in $(seq 90); do [ -s "$OUT/ray_address" ] && break; sleep 1; done
      (while sleep 2; do nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader; done) > "$OUT/cluster_apps.log" 2>&1 &
      watch_pid=$!
      (while sleep 2; do ps -eo pid=,args= | grep -E "ray::|grpo-async" | grep -v grep; done) > "$OUT/cluster_ps.log" 2>&1 &
      ps_pid=$!
      began=$(date +%s)
      LAYOUT_TIMEOUT=300 layout cluster grpo-async.py train_model.num_devices=2 inference_model.num_devices=2 \
        train.num_collectors=2 "ray.address=$(cat "$OUT/ray_address")"
      echo "   run $(( $(stat -c %Y "$OUT/layout_cluster/metrics.png") - began )) s to its summary, then $(( $(date +%s) - \
        $(stat -c %Y "$OUT/layout_cluster/metrics.png") )) s to exit"
      kill $watch_pid $ps_pid; kill $cluster_pid; wait $cluster_pid
      nvidia-smi --query-gpu=index,uuid --format=csv,noheader > "$OUT/cluster_gpus.log"
      python3 -c "
gpu = dict(reversed(l.strip().split(', ')) for l in open('$OUT/cluster_gpus.log') if l.strip())
names = {}
for l in open('$OUT/cluster_ps.log'):
    pid, _, args = l.strip().partition(' ')
    names[pid] = 'rank 0 (driver)' if 'grpo-async' in args else args.split()[0]
seen = sorted({(gpu.get(u.strip(), u), names.get(p.strip(), p)) for p, u in (l.split(',') for l in open('$OUT/cluster_apps.log') if ',' in l)})
print('   processes on each GPU:', seen)"
      layout local_ranks grpo-async.py train_model.num_devices=2 "inference_model.devices=[2,3]" train.num_collectors=2 ;;
    sharded)
      build qwen2.5-0.5b /tmp/q05
      timeout 200 python3 grpo/grpo.py --config-name grpo_tiny train.total_steps=3 model.name=/tmp/q05 \
        eval.frequency=0 eval.num_problems=32 logging.progress_bar=false logger=none allow_cpu=false \
        train_model.dtype=bfloat16 ref_model.dtype=bfloat16 inference_model.dtype=bfloat16 \
        inference_model.max_new_tokens=64 train.optim_batch_size=16 train_model.num_devices=2 \
        inference_model.colocate=true ref_model.colocate=true "hydra.run.dir=$OUT/sharded" > "$OUT/sharded.log" 2>&1
      echo "== sharded rc=$?"; grep -A4 "^Device allocation" "$OUT/sharded.log"; tail -3 "$OUT/sharded.log"
      grep step_time_s "$OUT/sharded/metrics.jsonl" | cut -c1-400 ;;
  esac
  echo "   ($part took $(( $(date +%s) - start )) s)"
done
