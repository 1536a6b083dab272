#!/usr/bin/env bash
# Issue 20/22 on one H200 after the staged prefill and the recalibration:
#  1. B = 8 and 16 with trees forced (--batch-tree), 20 MT-Bench queries, 3 repeats each;
#  2. eval-acceptance on the 20 MT-Bench queries (fp32): walked prediction vs measured.
# Needs the GGUF in /tmp/smdata (see scripts/gpu_setup.sh).
source scripts/gpu_setup.sh
for tree in calibrated-24+lookup-8 calibrated-64+lookup-8 calibrated-16+lookup-3; do
  timeout 100 python3 -m specmemo_core.cli bench --device cuda --dtype bf16 --batch 8,16 --batch-tree "$tree" \
    --repeats 3 --json --save "$OUT/batch_${tree//+/_}.json" > /dev/null 2> "$OUT/batch_${tree//+/_}.err"
  echo "$tree rc=$?"
  python3 - "$OUT/batch_${tree//+/_}.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for b, e in d.items():
    if not b.startswith("_"):
        print(" B", b, e["plain"]["tokens_per_s"]["median"], e["speculative"]["tokens_per_s"]["median"], e["speedup"],
              e["speculative"]["tokens_per_sequence_step"])
PY
done
timeout 200 python3 -m specmemo_core.cli eval-acceptance --device cuda --dtype fp32 --tree calibrated-48+lookup-8 \
  --tree calibrated-64 --tree medusa-64 --tree calibrated-8+lookup-3 --tree calibrated-12 --json \
  > "$OUT/eval_acceptance_recalibrated.json" 2> "$OUT/eval.err"
echo "eval rc=$?"; cat "$OUT/eval_acceptance_recalibrated.json"
