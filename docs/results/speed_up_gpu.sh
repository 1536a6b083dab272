#!/usr/bin/env bash
# Issue 21 item 2 on one H200: heads for the default model trained through the code path of the
# app's "Speed up this model" (tools/train/speed_up.py, as `specmemo speed-up` calls it), then
# tokens per step of the trained heads against the shipped ones, and the time estimate for a
# Llama-3-8B-shaped model. Three device calls made back to back (the machine keeps /tmp):
#
#   call1  (carry .whl .gguf1)  the estimate for shape:llama-3-8b (random weights of its real shape)
#   call2  (carry .whl .gguf2)  joins the GGUF; specmemo speed-up --device cuda (estimate, then train;
#                               a run cut by the timeout resumes in call3)
#   call3  (carry .whl)         finishes the training if cut; eval-acceptance of the shipped and the
#                               trained heads on the 20 MT-Bench queries (bf16, 128 new tokens)
#
# Run from the repository root with $OUT set:  bash docs/results/speed_up_gpu.sh call1   (then call2, call3)
set -x
source scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
TRAINED=/tmp/smdata/heads/SmolLM2-135M-Instruct-8ee17f029cc18776
SHIPPED=assets/heads/SmolLM2-135M-Instruct
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu_$1.txt"
case "$1" in
call1)
  timeout 400 python3 -m specmemo_core.cli speed-up --model shape:llama-3-8b --estimate --device cuda --json \
    > "$OUT/estimate_llama3_8b.json" 2> "$OUT/estimate_llama3_8b.err"
  echo "rc=$?"; cat "$OUT/estimate_llama3_8b.json"; tail -c 1500 "$OUT/estimate_llama3_8b.err"
  ;;
call2|call3)
  if [ ! -f "$TRAINED/card.json" ]; then
    timeout 520 python3 -m specmemo_core.cli speed-up --device cuda --json \
      > "$OUT/speed_up_$1.json" 2> "$OUT/speed_up_$1.err"
    echo "speed-up rc=$?"; grep -v "^\s*$" "$OUT/speed_up_$1.err" | tail -n 30
  fi
  cp "$TRAINED"/card.json "$TRAINED"/calibration.json "$TRAINED"/heads.safetensors "$TRAINED"/job.json "$OUT/" 2>/dev/null
  if [ "$1" = call3 ] && [ -f "$TRAINED/card.json" ]; then
    for h in shipped trained; do
      dir=$SHIPPED; [ $h = trained ] && dir=$TRAINED
      timeout 120 python3 -m specmemo_core.cli eval-acceptance --heads "$dir" --device cuda --dtype bf16 \
        --queries 20 --max-new-tokens 128 --tree calibrated-48+lookup-8 --tree calibrated-64 --tree medusa-64 \
        --json > "$OUT/eval_$h.json" 2> "$OUT/eval_$h.err"
      echo "$h rc=$?"; cat "$OUT/eval_$h.json" | head -c 1500; echo
    done
  fi
  ;;
esac
