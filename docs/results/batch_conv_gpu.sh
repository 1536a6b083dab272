#!/usr/bin/env bash
# Issue 20 on one H200 with conversations as clients: each MT-Bench conversation sends its
# turns in order, each request the conversation so far (--batch-requests conversations, the
# default). Device calls made back to back, the first `copy` (carrying .gguf1), the next one
# carrying .gguf2 and .whl:
#   run    `specmemo bench --batch 1,2,4,8,16` on 40 queries (20 conversations, so 16 slots
#          fill), bf16, 128 new tokens, 3 timed rounds; then at B = 8 on the fixed tree the
#          planner chose before grown trees batched, and at B = 8 with every turn a request
#          alone (--batch-requests turns, the earlier workload)
#   fp32   the CUDA tests of batched decoding and growth, then B = 8 in fp32 (every reply
#          identical to batched plain)
# Run from the repository root with $OUT set:  bash docs/results/batch_conv_gpu.sh copy|run|fp32
source scripts/gpu_setup.sh
bench() {  # name timeout_s args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m specmemo_core.cli bench --device cuda --dtype bf16 --repeats 3 --json \
    --save "$OUT/$name.json" "$@" > "$OUT/${name}_stdout.json" 2> "$OUT/$name.err"
  echo "$name rc=$?"; tail -c 400 "$OUT/$name.err"
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for b, e in d.items():
    if not b.startswith("_"):
        print(b, e["plain"]["tokens_per_s"], e["speculative"]["tree"], e["speculative"]["tokens_per_s"],
              e["speculative"]["tokens_per_sequence_step"], e["speedup"], e["speculative"]["identical_to_plain"])
PY
}
case "$1" in
copy)
  ls -la /tmp/part_aa ;;
run)
  bench batch_conversations 300 --batch 1,2,4,8,16 --queries 40
  bench batch_conversations_b8_fixed 100 --batch 8 --queries 40 --batch-tree calibrated-48+lookup-8
  bench batch_turns_b8 100 --batch 8 --queries 20 --batch-requests turns ;;
fp32)
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/core/test_batch_decoding.py tests/core/test_growth.py \
    -k "gpu or cuda" 2>&1 | tail -15 | tee "$OUT/gpu_pytest.txt"
  bench batch_conversations_b8_fp32 150 --batch 8 --queries 40 --dtype fp32 ;;
*)
  echo "usage: bash docs/results/batch_conv_gpu.sh copy|run|fp32"; exit 2 ;;
esac
