#!/usr/bin/env bash
# The real-size runs of issue 15 on one lent GPU (H100/H200; transformers backend, no vLLM there).
#   default_1p5b   the DEFAULT grpo_gsm8k config, 4 steps, with a random-init Qwen2.5-1.5B-shape model
#                  and the shipped data/gsm8k_tiny swapped in (backend transformers), and one generation batch
#                  a step: a random-init model scores 0 on every reply, so dynamic sampling (the default) would
#                  draw train.max_extra_generation_batches more every step
#   smollm_ifeval  real SmolLM2-135M-Instruct on the IFEval-format prompts of data/ifeval_tiny, 40 steps
#   smollm_gsm8k   real SmolLM2 on real GSM8K rows (grpo_smollm: 1,000 train / 319 held out), 100 steps
#   profile_1p5b   default_1p5b with step 3 recorded by torch.profiler (profile_step3.txt in its run dir): where
#                  the step's time goes, GPU and host (cProfile makes the first step's compiling too slow to wait for)
#   q05_lengths    real Qwen2.5-Coder-0.5B-Instruct (grpo_qwen05b, QWEN05: its folder), one generation batch a step,
#                  6 steps each with replies capped at 512 and at 128 tokens: the step and its train part against
#                  the real token count (issue 32)
#   q05_draws      the same model and recipe as is (dynamic sampling), 12 steps each with draws of 256 (the default:
#                  a second draw most steps, docs/step.md) and of 512 (one draw: the decode batch-insensitive at 0.5B?)
#   q05_packing    the same model, one generation batch a step, 8 steps each: packed rows (the default) and padded
#                  ones (train.packed_sequences=false) with replies capped at 512, packed rows capped at 128
#   packing_1p5b   default_1p5b with 6 steps, packed rows and padded ones
#   q05_compact    the same model, one generation batch a step, 8 steps each with inference_model.compact_rows off and
#                  on (rows whose reply ended leave the decode batch), then bench_generation.py's random-init 0.5B and
#                  1.5B shapes x 128 with replies ending after ~300 tokens (--mean-reply 300), ours against compact
# Each run's metrics.jsonl is summarised by benchmarks/summarize_run.py.
# Usage: KEEP=/root/keep SMOLLM=/path/model GSM8K_REAL=/path/data QWEN05=/path/model bash benchmarks/real_size.sh PART...
set -uo pipefail
KEEP=${KEEP:-/tmp/real_size}
SMOLLM=${SMOLLM:-assets/smollm2-135m-instruct}
GSM8K_REAL=${GSM8K_REAL:-data/gsm8k_real}
QWEN05=${QWEN05:-assets/qwen2.5-coder-0.5b-instruct}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p "$KEEP/runs"
common=(logger=none logging.progress_bar=false)

run() {  # run NAME TIMEOUT grpo.py-args...: the run dir is $KEEP/runs/NAME
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" python3 grpo/grpo.py "$@" "${common[@]}" "hydra.run.dir=$KEEP/runs/$name" > "$KEEP/runs/$name.log" 2>&1
  echo "== $name rc=$? wall=$(( $(date +%s) - t0 ))s"
  grep -E "^error|Error|error:" "$KEEP/runs/$name.log" | tail -5
  python3 benchmarks/summarize_run.py "$KEEP/runs/$name" > "$KEEP/runs/$name.summary.txt" 2>&1
  head -c 6000 "$KEEP/runs/$name.summary.txt"
}

random_init_1p5b() {  # the random-init Qwen2.5-1.5B shape, built once into $KEEP/q15
  [ -f "$KEEP/q15/config.json" ] || python3 -c "
import sys; sys.path.insert(0, 'benchmarks')
from pathlib import Path
from bench_vs_trl import build_random_init_model
build_random_init_model('qwen2.5-1.5b', 'assets/tiny-model', Path('$KEEP/q15'), seed=0)" > /dev/null
}
default_1p5b=(model.name="$KEEP/q15" env.dataset=data/gsm8k_tiny inference_model.backend=transformers
              train.total_steps=4 train.dynamic_sampling=false eval.frequency=0 eval.num_problems=16 logging.export=false)
q05=(--config-name grpo_qwen05b model.name="$QWEN05" env.dataset="$GSM8K_REAL" eval.frequency=0 train.checkpoint_frequency=0
     logging.export=false)

for part in "$@"; do
  case $part in
    default_1p5b)
      random_init_1p5b
      run default_1p5b 470 "${default_1p5b[@]}" ;;
    profile_1p5b)
      random_init_1p5b
      run profile_1p5b 470 "${default_1p5b[@]}" logging.profile_step=3
      head -40 "$KEEP/runs/profile_1p5b/profile_step3.txt" ;;
    q05_lengths)
      run q05_cap512 300 "${q05[@]}" train.total_steps=6 train.dynamic_sampling=false
      run q05_cap128 300 "${q05[@]}" train.total_steps=6 train.dynamic_sampling=false inference_model.max_new_tokens=128 ;;
    q05_packing)
      run q05_packed 300 "${q05[@]}" train.total_steps=8 train.dynamic_sampling=false
      run q05_padded 300 "${q05[@]}" train.total_steps=8 train.dynamic_sampling=false train.packed_sequences=false
      run q05_packed128 300 "${q05[@]}" train.total_steps=8 train.dynamic_sampling=false inference_model.max_new_tokens=128 ;;
    packing_1p5b)
      random_init_1p5b
      run packed_1p5b 470 "${default_1p5b[@]}" train.total_steps=6
      run padded_1p5b 470 "${default_1p5b[@]}" train.total_steps=6 train.packed_sequences=false ;;
    q05_draws)
      run q05_draw256 300 "${q05[@]}" train.total_steps=12
      run q05_draw512 300 "${q05[@]}" train.total_steps=12 env.num_envs=512 ;;
    q05_compact)
      run q05_whole_batch 300 "${q05[@]}" train.total_steps=8 train.dynamic_sampling=false inference_model.compact_rows=false
      run q05_compacted 300 "${q05[@]}" train.total_steps=8 train.dynamic_sampling=false inference_model.compact_rows=true
      timeout 400 python3 benchmarks/bench_generation.py --shapes qwen2.5-0.5b,qwen2.5-1.5b --batches 128 \
        --variants ours,compact --mean-reply 300 --out "$KEEP/runs/bench_compact.json" ;;
    smollm_ifeval)  # IFEVAL_EXTRA: more overrides, IFEVAL_NAME: its run name
      run "${IFEVAL_NAME:-smollm_ifeval}" 560 --config-name grpo_ifeval_tiny model.name="$SMOLLM" env.repeats=8 env.num_envs=64 \
        train.dialog_turns_per_batch=64 train.optim_batch_size=32 inference_model.max_new_tokens=96 \
        train.total_steps=40 optimizer.lr=1e-5 optimizer.schedule=cosine optimizer.warmup_steps=5 allow_cpu=false \
        ${IFEVAL_EXTRA:-} ;;
    smollm_gsm8k)
      run smollm_gsm8k 1500 --config-name grpo_smollm model.name="$SMOLLM" env.dataset="$GSM8K_REAL" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
