#!/usr/bin/env bash
# Issue 22 item 2 on one H200: scripts/feature_layers_trial.py (hydra heads whose context layer also
# reads inner base layers) on 4,000 distilled replies. Device calls made back to back:
#   copy            (carry .gguf1)        the GGUF's first part to /tmp
#   VARIANTS STEPS  (carry .gguf2 .whl)   joins the GGUF; trains and scores VARIANTS (comma-separated)
# The distilled replies stay in /tmp/trial between calls and come back in $OUT; carried in .out/trial/
# they are not generated again.
# Run from the repository root with $OUT set:  bash docs/results/feature_layers_gpu.sh copy | base,15 3000
source scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
case "$1" in
copy) ls -la /tmp/part_aa ;;
*)
  mkdir -p /tmp/trial; cp -n .out/trial/*.safetensors /tmp/trial/ 2>/dev/null  # replies of an earlier call, if carried
  timeout "${3:-540}" python3 scripts/feature_layers_trial.py --out /tmp/trial --variants "$1" --steps "${2:-3000}" \
    > "$OUT/trial_$1.log" 2> "$OUT/trial_$1.err"
  echo "rc=$?"; cat "$OUT/trial_$1.log"; grep -v Warning "$OUT/trial_$1.err" | tail -n 5
  cp /tmp/trial/*.safetensors /tmp/trial/trial.json "$OUT/" 2>/dev/null ;;
esac
