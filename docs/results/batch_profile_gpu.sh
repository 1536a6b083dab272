#!/usr/bin/env bash
# Issue 20: where batched speculation's time goes on one H200 (default model, bf16).
#   call1  set-up only (carries .gguf1): bash docs/results/batch_profile_gpu.sh call1
#   call2  at once (carries .gguf2):     bash docs/results/batch_profile_gpu.sh call2
# Each profile: the 20 MT-Bench queries as concurrent requests through a batch decoder of B
# slots, plain and speculative, 2 passes (the last reported), then one full step's phases.
source scripts/gpu_setup.sh
case "$1" in
call1) nvidia-smi --query-gpu=name,memory.total --format=csv; ls -la /tmp/part_aa ;;
call2)
  ls -la /tmp/smdata/models/
  for spec in "8 calibrated-8+lookup-3" "8 calibrated-48+lookup-8" "1 calibrated-48+lookup-8" "16 calibrated-8+lookup-3"; do
    set -- $spec
    timeout 120 python3 -m specmemo_core.tools.batch_profile --batch "$1" --tree "$2" --dtype bf16 --json \
      > "$OUT/profile_b$1_${2//+/_}.json" 2> "$OUT/profile_b$1.err"
    echo "B=$1 $2 rc=$?"; cat "$OUT/profile_b$1_${2//+/_}.json"; tail -2 "$OUT/profile_b$1.err"
  done ;;
esac
