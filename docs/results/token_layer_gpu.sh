# Issue 23, a plain step's layer as fused kernels (runtime/token_layer.py) on the GPU machine (device
# tool), from the repository root, carrying .whl (and, for bench, the GGUF as gpu_setup.sh says):
#   bash docs/results/token_layer_gpu.sh [exact|tune|profile|steps|stepmodel|bench] [shapes]
#   exact: the GPU decoders' tests (greedy speculative = plain greedy, fp32) with the kernels
#   tune:  vicuna-7b plain steps under launches PAIRS:ROWS:BLOCK_K:WARPS against the regions, 1 round
#   profile: one plain vicuna-7b step's kernels under the profiler
#   steps: whole steps (time_graph_steps.py), the kernels against the compiled regions, 3 rounds alternating
#   bench: specmemo bench on the 20 MT-Bench queries, bf16 and fp32 (bench/)
#   stepmodel: the planner's step model against whole graph steps of its trees (check_step_model.py)
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-exact}
V=${V:-compiled@2:2:512:4:1,compiled@2:2:1024:4:1,compiled@2:4:512:4:1,compiled@2:2:256:4:1,compiled@4:4:512:4:1,compiled@2:2:512:8:1,compiled@1:2:1024:4:1}
case "$what" in
exact)
  timeout ${2:-200} python3 -m pytest -q -p no:cacheprovider tests/core/test_token_layer.py tests/core/test_static_decoding.py \
    tests/core/test_chunked_attention.py tests/core/test_growth.py tests/core/test_batch_decoding.py > "$OUT/exact.log" 2>&1
  tail -3 "$OUT/exact.log" ;;
tune)
  timeout ${2:-240} python3 scripts/time_graph_steps.py --shape vicuna-7b --dtype bf16 --trees single --steps 60 \
    --regions compiled-regions,$V --repeats 1 > "$OUT/tune-vicuna-7b.jsonl" 2> "$OUT/tune-vicuna-7b.err"
  grep -v '"shape"' "$OUT/tune-vicuna-7b.jsonl"; tail -2 "$OUT/tune-vicuna-7b.err" | cut -c 1-300 ;;
profile)  # where a plain step's kernel time goes (time_graph_steps.py --kernels: one eager step under the profiler)
  timeout ${2:-150} python3 scripts/time_graph_steps.py --shape vicuna-7b --dtype bf16 --trees single --modes graphs \
    --steps 30 --kernels > "$OUT/profile-vicuna-7b.jsonl" 2> "$OUT/profile-vicuna-7b.err"
  cut -c 1-1500 "$OUT/profile-vicuna-7b.jsonl" ;;
steps)
  for shape in ${2:-vicuna-7b llama-3-8b smollm2-135m}; do
    timeout ${3:-200} python3 scripts/time_graph_steps.py --shape $shape --dtype bf16 --trees single,medusa-64 \
      --steps 100 --regions compiled,compiled-regions --repeats 3 > "$OUT/$shape-steps.jsonl" 2> "$OUT/$shape-steps.err"
    tail -1 "$OUT/$shape-steps.jsonl"; tail -2 "$OUT/$shape-steps.err" | cut -c 1-300
  done ;;
stepmodel)
  timeout ${2:-200} python3 scripts/check_step_model.py ${3:-128,1000} > "$OUT/step_model.jsonl" 2> "$OUT/step_model.err"
  cat "$OUT/step_model.jsonl" ;;
bench)  # as the chunked attention's runs: the same methods, files and limits
  bash docs/results/chunked_attention_gpu.sh bench ;;
esac
