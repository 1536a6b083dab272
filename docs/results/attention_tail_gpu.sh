# Issue 23 (and 22), session 27: the chunked attention reading its bias only at the step's own
# slots (runtime/chunked_attention.py, TAIL_BIAS) on the GPU machine (device tool), from the
# repository root, carrying .whl. Results: attention_tail_h100/ (FILES.md there).
#   bash docs/results/attention_tail_gpu.sh [parts|steps|profile|exact]
#   parts:   the attention alone, 32 layers a CUDA graph (scripts/time_step_parts.py), plain and
#            64-node steps, the bias read at the step's own slots (chunked) or at every slot (:all)
#   steps:   whole graph steps of the code as it is (not run yet in session 27: no device came):
#            vicuna-7b's shape (random hydra heads drafting over 8,192 tokens) and the default
#            model's with the shipped heads
#   profile: one eager vicuna-7b step of each tree under the profiler: kernels and GPU µs by phase
#   exact:   the attention's, the layer kernels' and the static decoder's tests on the GPU
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-parts}" in
parts)
  for shape in ${SHAPES:-vicuna-7b llama-3-8b smollm2-135m}; do
    timeout ${2:-100} python3 scripts/time_step_parts.py --shape $shape --parts attention --no-others \
      --variants 128:4:auto:all --repeats 3 \
      > "$OUT/parts-$shape.jsonl" 2> "$OUT/parts-$shape.err"
    echo "$shape rc=$?"; grep -o '"tokens": [0-9]*, "part": "[^"]*", "median": [0-9.]*' "$OUT/parts-$shape.jsonl" | sed 's/"tokens": //;s/"part": "attention //;s/", "median"//'
    grep -o '"chunked[^"]*_vs_sdpa_max_abs": [0-9.e-]*' "$OUT/parts-$shape.jsonl" | sort | uniq -c
    tail -1 "$OUT/parts-$shape.err" | cut -c 1-300
  done ;;
steps)
  for round in ${ROUNDS:-1 2}; do
    timeout ${2:-120} python3 scripts/time_graph_steps.py --shape vicuna-7b --dtype bf16 \
      --draft-vocab 8192 --steps 40 --repeats 2 --trees single,medusa-64 --regions compiled \
      > "$OUT/vicuna-7b-$round.jsonl" 2> "$OUT/vicuna-7b-$round.err"
    echo "vicuna round $round rc=$?"; grep -v '"shape"' "$OUT/vicuna-7b-$round.jsonl" | cut -c 1-120
    timeout ${2:-120} python3 scripts/time_graph_steps.py --shape smollm2-135m --dtype bf16 \
      --heads assets/heads/SmolLM2-135M-Instruct --steps 100 --repeats 2 --trees single,medusa-64,1-10-16-17+lookup-8 \
      --regions compiled > "$OUT/smollm2-135m-$round.jsonl" 2> "$OUT/smollm2-135m-$round.err"
    echo "smollm2 round $round rc=$?"; grep -v '"shape"' "$OUT/smollm2-135m-$round.jsonl" | cut -c 1-120
  done ;;
profile)
  timeout ${2:-200} python3 scripts/time_graph_steps.py --shape vicuna-7b --dtype bf16 --draft-vocab 8192 --steps 40 \
    --trees single,medusa-64 --modes graphs --kernels --compile > "$OUT/profile-vicuna-7b.jsonl" 2> "$OUT/profile-vicuna-7b.err"
  python3 scripts/show_step_profile.py "$OUT/profile-vicuna-7b.jsonl" ;;
exact)
  timeout ${2:-200} python3 -m pytest -q -p no:cacheprovider tests/core/test_chunked_attention.py \
    tests/core/test_static_decoding.py tests/core/test_token_layer.py tests/core/test_step_kernels.py > "$OUT/exact.log" 2>&1
  tail -3 "$OUT/exact.log" ;;
esac
