# Issues 22, 23, session 28: programmatic dependent launch over the whole layer chain (the tile
# kernels and the chunked attention's two launched as the one-token matmuls already were) and
# the greedy picks in two kernels (step_kernels.greedy_picks), on
# the GPU machine (device tool), from the repository root, carrying .whl (bench: the GGUF too,
# as scripts/gpu_setup.sh says). Results: chain_pdl_h100/ or chain_pdl_h200/ (FILES.md there).
#   bash docs/results/chain_pdl_gpu.sh [steps|profile|exact|bench]
#   steps: whole graph steps, 1,000-token context, alternating in one process: everything on
#          (compiled) against PDL for the one-token matmuls only (compiled-nopdlchain) and the
#          acceptance's argmax through blocks of matmuls (compiled-nopicks); the default model's
#          shape with the shipped heads, then vicuna-7b's (random hydra heads, 8,192 tokens)
#   profile: one eager step of each tree of the default model's shape (the shipped heads) under
#          the profiler: kernels and GPU µs by phase
#   exact: the attention's, the layer kernels', the glue kernels' and the static decoder's tests
#   bench: specmemo bench, bf16, 20 MT-Bench queries, vanilla+graphs, medusa-64+graphs and plan
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
REGIONS=${REGIONS:-compiled,compiled-pdl:2:2:0,compiled-pdl:1:1:0,compiled-pdl:2:1:0,compiled-pdl:2:1:1,compiled-prenorm,compiled-nopicks}
case "${1:-steps}" in
steps)
  timeout ${2:-200} python3 scripts/time_graph_steps.py --shape smollm2-135m --dtype bf16 \
    --heads assets/heads/SmolLM2-135M-Instruct --steps 100 --repeats 3 --trees ${TREES:-single,medusa-64,1-10-16-17+lookup-8} \
    --regions $REGIONS > "$OUT/smollm2-135m.jsonl" 2> "$OUT/smollm2-135m.err"
  echo "smollm2 rc=$?"; grep -v '"shape"' "$OUT/smollm2-135m.jsonl" | cut -c 1-160
  timeout ${3:-240} python3 scripts/time_graph_steps.py --shape vicuna-7b --dtype bf16 \
    --draft-vocab 8192 --steps 40 --repeats 3 --trees single,medusa-64 --regions $REGIONS \
    > "$OUT/vicuna-7b.jsonl" 2> "$OUT/vicuna-7b.err"
  echo "vicuna rc=$?"; grep -v '"shape"' "$OUT/vicuna-7b.jsonl" | cut -c 1-160
  tail -2 "$OUT"/*.err | cut -c 1-300 ;;
profile)
  timeout ${2:-150} python3 scripts/time_graph_steps.py --shape smollm2-135m --dtype bf16 \
    --heads assets/heads/SmolLM2-135M-Instruct --steps 50 --trees single,medusa-64 --modes graphs --kernels \
    > "$OUT/profile-smollm2-135m.jsonl" 2> "$OUT/profile-smollm2-135m.err"
  python3 scripts/show_step_profile.py "$OUT/profile-smollm2-135m.jsonl" | cut -c 1-200 ;;
exact)
  timeout ${2:-300} python3 -m pytest -q -p no:cacheprovider tests/core/test_chunked_attention.py \
    tests/core/test_token_layer.py tests/core/test_step_kernels.py tests/core/test_static_decoding.py \
    > "$OUT/exact.log" 2>&1
  tail -3 "$OUT/exact.log" ;;
bench)
  timeout ${2:-400} python3 -m specmemo_core.cli bench --device cuda --dtype bf16 \
    --methods vanilla+graphs,medusa-64+graphs,plan --queries 20 --max-new-tokens 128 --repeats 3 --warmup 1 --json \
    --save "$OUT/bench_mtbench20_bf16.json" > /dev/null 2> "$OUT/bench_mtbench20_bf16.err"
  echo "bench rc=$?"; grep -i "tok/s\|plan\|chose" "$OUT/bench_mtbench20_bf16.err" | tail -6 | cut -c 1-250 ;;
esac
