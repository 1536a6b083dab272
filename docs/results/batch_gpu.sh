#!/usr/bin/env bash
# Issue 20 on one H200 after the staged prefill: the CUDA tests of batched decoding, then
# `specmemo bench --batch 1,2,4,8,16` (default model, bf16, 20 MT-Bench queries as
# concurrent requests, 128 new tokens, 3 timed rounds) and a profile at B = 8.
# Needs the GGUF in /tmp/smdata (a call that carried .gguf2 right before, see scripts/gpu_setup.sh).
source scripts/gpu_setup.sh
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/core/test_batch_decoding.py -k gpu 2>&1 | tail -4
timeout 330 python3 -m specmemo_core.cli bench --device cuda --dtype bf16 --batch 1,2,4,8,16 --repeats 3 --json \
  --save "$OUT/batch_bench.json" > "$OUT/batch_bench_stdout.json" 2> "$OUT/batch_bench.err"
echo "bench rc=$?"; tail -c 600 "$OUT/batch_bench.err"
python3 - "$OUT/batch_bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for b, e in d.items():
    if not b.startswith("_"):
        print(b, e["plain"]["tokens_per_s"]["median"], e["speculative"]["tree"], e["speculative"]["tokens_per_s"]["median"], e["speedup"])
PY
timeout 90 python3 -m specmemo_core.tools.batch_profile --batch 8 --tree calibrated-48+lookup-8 --dtype bf16 --json \
  > "$OUT/profile_b8.json" 2> "$OUT/profile_b8.err"; echo "profile rc=$?"; cat "$OUT/profile_b8.json"
