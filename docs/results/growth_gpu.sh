#!/usr/bin/env bash
# Issue 22 item 1 on one H200: grown trees (dynamic-N) against the fixed calibrated trees of
# the same size, in one process, default model with its shipped heads, CUDA graphs.
#
#   copy   (first call, carrying .gguf1) puts the first GGUF part in place
#   bench  (next call at once, carrying .gguf2 and .whl) joins the GGUF and runs the bench:
#          bf16, 20 MT-Bench queries, 128 new tokens, 1 warm-up + 3 timed rounds; then an
#          fp32 pass (1 round) for the replies' identity to plain greedy
#   start  the same bench in its own process session (it outlives the call), into /tmp/growth;
#   collect (a later call at once) waits for it (up to ~9.5 min) and copies its files to $OUT
#
# Run from the repository root with $OUT set:  bash docs/results/growth_gpu.sh copy ; ... bench
set -x
source scripts/gpu_setup.sh
export PYTHONPATH=/tmp/site:.
GGUF=/tmp/smdata/models/SmolLM2-135M-Instruct.Q4_1.gguf
case "$1" in
start)
  mkdir -p /tmp/growth
  OUT=/tmp/growth setsid nohup bash "$0" bench > /tmp/growth/run.log 2>&1 < /dev/null &
  sleep 5; cat /tmp/growth/run.log ;;
collect)
  for _ in $(seq 114); do pgrep -f "growth_gpu.sh bench" > /dev/null || break; sleep 5; done
  cp /tmp/growth/* "$OUT"/; tail -c 2000 /tmp/growth/run.log ;;
copy)
  ls -la /tmp/part_aa ;;
bench)
  ls -la "$GGUF" || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
  G=vanilla+graphs,calibrated-8+graphs,dynamic-8+graphs,calibrated-24+graphs,dynamic-24+graphs
  G=$G,calibrated-64+lookup-8+graphs,dynamic-64+lookup-8+graphs,plan
  timeout 330 python3 -m specmemo_core.cli bench --device cuda --dtype bf16 --methods "$G" --queries 20 \
    --max-new-tokens 128 --repeats 3 --warmup 1 --json --save "$OUT/growth_bf16.json" > /dev/null 2> "$OUT/growth_bf16.err"
  echo "bf16 rc=$?"; tail -c 3000 "$OUT/growth_bf16.err" ;;
fp32)  # eager (no graphs) and 1 round: for the replies' identity to plain greedy, not for speed
  M=vanilla,calibrated-8,dynamic-8,calibrated-24,dynamic-24,calibrated-64+lookup-8,dynamic-64+lookup-8,plan
  timeout 200 python3 -m specmemo_core.cli bench --device cuda --dtype fp32 --methods "$M" --queries 20 \
    --max-new-tokens 128 --repeats 1 --warmup 0 --json --save "$OUT/growth_fp32.json" > /dev/null 2> "$OUT/growth_fp32.err"
  echo "fp32 rc=$?"; tail -c 3000 "$OUT/growth_fp32.err" ;;
*)
  echo "usage: bash docs/results/growth_gpu.sh copy|bench|fp32|start|collect"; exit 2 ;;
esac
