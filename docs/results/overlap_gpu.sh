# Overlapped steps (Decoder.generate starts each greedy step before it reads the last) on the GPU
# machine (device tool), from the repository root, carrying .whl (and, for bench, the GGUF as
# scripts/gpu_setup.sh says):   bash docs/results/overlap_gpu.sh [exact|overhead|bench]
#   exact:    the static decoder's tests on CUDA (graphs, steps overlapped by default; fp32 greedy equality)
#   overhead: scripts/time_step_overhead.py: a step's wall time in the loop, overlapped and serial,
#             against its graph's replays alone (the default model's shape, its trained heads)
#   bench:    specmemo bench, 20 MT-Bench queries, bf16 and fp32: overlapped and +serial methods in one run
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-exact}" in
exact)
  timeout ${2:-150} python3 -m pytest -q -p no:cacheprovider tests/core/test_static_decoding.py > "$OUT/exact.log" 2>&1
  tail -3 "$OUT/exact.log" ;;
overhead)
  timeout ${2:-300} python3 scripts/time_step_overhead.py ${3:-300,1000} > "$OUT/step_overhead.jsonl" 2> "$OUT/step_overhead.err"
  cat "$OUT/step_overhead.jsonl"; tail -2 "$OUT/step_overhead.err" | cut -c 1-300 ;;
bench)
  for d in ${2:-bf16 fp32}; do
    timeout ${3:-200} python3 -m specmemo_core.cli bench --device cuda --dtype $d \
      --methods vanilla+graphs,vanilla+graphs+serial,medusa-64+graphs,plan,plan+serial \
      --queries 20 --max-new-tokens 128 --repeats 3 --warmup 1 --json --save "$OUT/bench_mtbench20_$d.json" \
      > /dev/null 2> "$OUT/bench_mtbench20_$d.err"
    echo "$d rc=$?"; tail -2 "$OUT/bench_mtbench20_$d.err" | cut -c 1-300
  done ;;
esac
