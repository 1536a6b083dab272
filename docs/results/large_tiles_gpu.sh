# Issue 23, session 29: a large layer's tree steps as tiles (token_layer.tile_shape) and the chunked
# attention's merge taking several rows a program (chunked_attention.MERGE_ROWS), on the GPU machine
# (device tool), from the repository root, carrying .whl_lite (bench: a GGUF part too, as
# scripts/gpu_setup.sh says). Results: large_tiles_h100/ (FILES.md there).
#   bash docs/results/large_tiles_gpu.sh [attention|steps|exact|profile|small|busy|bench]
#   attention: vicuna-7b's attention alone (32 layers, T = 1 and 64, span 1,024), the merge at 1, 2, 4 and 8
#          rows a program (SPLIT:WARPS:STAGES:MERGE_ROWS), 8 warps, chunks of 256
#   steps: whole vicuna-7b graph steps, 1,000-token context, alternating in one process: the code's
#          default (large tiles) against cuBLAS and the regions (compiled-notiles)
#   exact: the layer kernels', the attention's and the step kernels' tests on the GPU
#   profile: one eager vicuna-7b step of each (plain, medusa-64) under the profiler, kernels and GPU µs by
#          phase and name (scripts/show_step_profile.py shows them)
#   small: the default model's shape with the shipped heads, whole graph steps
#   bench: specmemo bench, bf16, 20 MT-Bench queries (chain_pdl_gpu.sh bench), the planner's step timing
#          and its plan (to see why it took the tree it took: a 64-node step cost what a 20-node one did)
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-steps}" in
attention)
  PYTHONPATH=$PYTHONPATH:scripts timeout ${2:-100} python3 scripts/time_step_parts.py --shape vicuna-7b \
    --parts attention --no-others --span 1024 \
    --variants ${V:-128:4:auto:1,128:4:auto:2,128:4:auto:4,128:4:auto:8,128:8:auto:4,256:4:auto:4} \
    > "$OUT/attention-vicuna-7b.jsonl" 2> "$OUT/attention-vicuna-7b.err"
  echo "attention rc=$?"; grep -v '"shape"\|max_abs' "$OUT/attention-vicuna-7b.jsonl" | cut -c 1-110 ;;
steps)
  timeout ${2:-200} python3 scripts/time_graph_steps.py --shape ${SHAPE:-vicuna-7b} --dtype bf16 --draft-vocab 8192 \
    --steps 40 --repeats ${REPEATS:-3} --trees single,medusa-64 --regions ${REGIONS:-compiled,compiled-notiles} \
    > "$OUT/${SHAPE:-vicuna-7b}.jsonl" 2> "$OUT/${SHAPE:-vicuna-7b}.err"
  echo "steps rc=$?"; grep -v '"shape"' "$OUT/${SHAPE:-vicuna-7b}.jsonl" | cut -c 1-160 ;;
exact)
  timeout ${2:-150} python3 -m pytest -q -p no:cacheprovider tests/core/test_token_layer.py \
    tests/core/test_chunked_attention.py tests/core/test_step_kernels.py > "$OUT/exact_token_layer.log" 2>&1
  tail -2 "$OUT/exact_token_layer.log" ;;
profile)
  timeout ${2:-150} python3 scripts/time_graph_steps.py --shape ${SHAPE:-vicuna-7b} --dtype bf16 --trees ${TREES:-single,medusa-64} \
    --modes graphs --steps 30 --kernels --compile --draft-vocab 8192 ${HEADS:+--heads $HEADS} \
    > "$OUT/profile-${SHAPE:-vicuna-7b}.jsonl" 2> "$OUT/profile-${SHAPE:-vicuna-7b}.err"
  echo "profile rc=$?"; python3 scripts/show_step_profile.py "$OUT/profile-${SHAPE:-vicuna-7b}.jsonl" | head -60 ;;
small)
  timeout ${2:-120} python3 scripts/time_graph_steps.py --shape smollm2-135m --dtype bf16 \
    --heads assets/heads/SmolLM2-135M-Instruct --steps 100 --repeats ${REPEATS:-3} --trees ${TREES:-single,medusa-64,1-10-16-17+lookup-8} \
    --regions ${REGIONS:-compiled} > "$OUT/smollm2-135m.jsonl" 2> "$OUT/smollm2-135m.err"
  echo "small rc=$?"; grep -v '"shape"' "$OUT/smollm2-135m.jsonl" | cut -c 1-160 ;;
busy)  # session 31: the attention's rows a program by the SMs (chunked_attention.busy_rows) against 64 (-am64)
  timeout 170 python3 -m pytest -q -p no:cacheprovider tests/core/test_chunked_attention.py tests/core/test_token_layer.py \
    tests/core/test_static_decoding.py > "$OUT/exact.log" 2>&1; tail -1 "$OUT/exact.log"
  timeout 100 python3 scripts/time_graph_steps.py --shape smollm2-135m --dtype bf16 --heads assets/heads/SmolLM2-135M-Instruct \
    --steps 100 --repeats 3 --context 900 --trees single,calibrated-12+lookup-8,medusa-64 --regions compiled,compiled-am64,compiled#16:64:4:5:64 \
    > "$OUT/smollm2-135m.jsonl" 2> "$OUT/smollm2-135m.err"
  echo "small rc=$?"; grep -v '"shape"' "$OUT/smollm2-135m.jsonl" | cut -c 1-150
  PYTHONPATH=$PYTHONPATH:scripts timeout ${2:-150} python3 scripts/check_step_model.py 128,900 > "$OUT/step_model.jsonl" \
    2> "$OUT/step_model.err"; echo "model rc=$?"; cut -c 1-160 "$OUT/step_model.jsonl" ;;
bench)  # then the planner's step timing (its fitted costs) beside the bench, and each tree's prediction
  bash docs/results/chain_pdl_gpu.sh bench ${2:-400}
  find "$SPECMEMO_DATA_DIR" -name step_timing.json -exec cp {} "$OUT/" \;
  timeout 60 python3 -m specmemo_core.cli plan --device cuda --dtype bf16 --json > "$OUT/plan.json" 2> "$OUT/plan.err"
  echo "plan rc=$?" ;;
esac
