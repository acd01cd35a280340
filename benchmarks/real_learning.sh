#!/usr/bin/env bash
# The real-learning run: a real Qwen2.5-Coder instruct model on real GSM8K rows with the default recipe
# (config grpo_qwen05b / grpo_qwen15b), in pieces of at most PIECE_MIN minutes of wall-clock each. A
# piece that reaches its limit is sent SIGTERM, which checkpoints the run; the next call of the same
# NAME resumes it. Then benchmarks/learning_curve.py draws the curves.
#
#   KEEP=/root/keep PIECE_MIN=9 bash benchmarks/real_learning.sh NAME CONFIG [override ...]
#   SCRIPT=grpo/grpo-async.py bash benchmarks/real_learning.sh ...   # the async script (default: grpo/grpo.py)
#   bash benchmarks/real_learning.sh q05_s0 grpo_qwen05b seed=0     # again until it prints "finished"
#   python benchmarks/learning_curve.py $KEEP/runs/q05_s0 $KEEP/runs/q05_s1 --out benchmarks/real_learning
set -uo pipefail
[ $# -ge 2 ] || { echo "usage: bash benchmarks/real_learning.sh NAME CONFIG [override ...]"; exit 2; }
name=$1 config=$2; shift 2
KEEP=${KEEP:-outputs/real_learning}
PIECE_MIN=${PIECE_MIN:-9}
SCRIPT=${SCRIPT:-grpo/grpo.py}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
run_dir="$KEEP/runs/$name"
mkdir -p "$KEEP/runs"
if grep -q "^run finished" "$run_dir.log" 2>/dev/null; then echo "== $name finished already"; exit 0; fi
where=("hydra.run.dir=$run_dir")
# a resumed piece continues in $run_dir; Hydra's own files of the piece go beside it, not into outputs/
ls "$run_dir"/checkpoints/*.json >/dev/null 2>&1 && where=("resume=$run_dir" "hydra.run.dir=$KEEP/runs/.pieces/$name-$(date +%s)")
t0=$(date +%s)
# -k: a checkpoint of a 1.5B model takes a while to write; KILL only if it hangs
timeout -k 300 "$((PIECE_MIN * 60))" python3 "$SCRIPT" --config-name "$config" "$@" "${where[@]}" \
  logger=none logging.progress_bar=false >> "$run_dir.log" 2>&1
rc=$?
echo "== $name rc=$rc wall=$(( $(date +%s) - t0 ))s"
grep -E "eval accuracy|^run |rror" "$run_dir.log" | tail -8
