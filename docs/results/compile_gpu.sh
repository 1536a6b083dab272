#!/usr/bin/env bash
# Issue 23 item 3 on one H200 with the default model: compiled layer regions (bench's +compiled
# methods, CausalLM.compile_layers) against eager ones in one run. Device calls made back to
# back, the first `copy` (carrying .gguf1), the next `run` carrying .gguf2 and .whl:
#   run   bf16, 20 MT-Bench queries, 128 new tokens, 1 warm-up and 3 timed rounds:
#         vanilla+graphs, vanilla+graphs+compiled, plan, plan+compiled; then fp32, one round:
#         every greedy reply of the compiled methods against vanilla+graphs
# Run from the repository root with $OUT set:  bash docs/results/compile_gpu.sh copy|run
source scripts/gpu_setup.sh
bench() {  # name timeout_s args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -m specmemo_core.cli bench --device cuda --queries 20 --json \
    --save "$OUT/$name.json" "$@" > "$OUT/${name}_stdout.json" 2> "$OUT/$name.err"
  echo "$name rc=$?"; tail -c 300 "$OUT/$name.err"
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
for name, r in json.load(open(sys.argv[1])).items():
    if not name.startswith("_"):
        print(name, r["tree"], r["tokens_per_s"], r["mean_accepted"], r["identical_to_vanilla"], r["replies"])
PY
}
case "$1" in
copy)
  ls -la /tmp/part_aa ;;
run)
  bench compile_bf16 300 --dtype bf16 --repeats 3 --methods vanilla+graphs,vanilla+graphs+compiled,plan,plan+compiled
  bench compile_fp32 200 --dtype fp32 --repeats 1 --warmup 0 \
    --methods vanilla+graphs,vanilla+graphs+compiled,plan+compiled ;;
*)
  echo "usage: bash docs/results/compile_gpu.sh copy|run"; exit 2 ;;
esac
