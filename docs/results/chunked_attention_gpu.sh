# Issue 23, the chunked attention (runtime/chunked_attention.py) on the GPU machine (device tool),
# from the repository root, carrying .whl:   bash docs/results/chunked_attention_gpu.sh [parts|steps|exact]
#   parts: attention alone (ours against cuDNN's SDPA, 32 layers, T = 1 and a 64-node tree), spans 1,024 and 2,048
#   steps: whole 7B-shaped steps (time_graph_steps.py), compiled regions with ours and with SDPA, alternating
#   exact: the static decoder's tests on the GPU (greedy speculative = plain greedy, fp32)
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
what=${1:-parts}
if [ "$what" = parts ]; then
  for shape in vicuna-7b llama-3-8b; do for span in 1024 2048; do
    timeout 100 python3 scripts/time_step_parts.py --shape $shape --parts attention --no-others --span $span \
      > "$OUT/$shape-attention-span$span.jsonl" 2> "$OUT/$shape-attention-span$span.err"
    grep -v '"shape"' "$OUT/$shape-attention-span$span.jsonl"; tail -3 "$OUT/$shape-attention-span$span.err" | cut -c 1-300
  done; done
elif [ "$what" = steps ]; then
  for shape in ${2:-vicuna-7b llama-3-8b}; do
    timeout ${3:-250} python3 scripts/time_graph_steps.py --shape $shape --dtype bf16 --trees single,medusa-64 \
      --steps 100 --regions compiled,compiled-sdpa --repeats 3 > "$OUT/$shape-steps.jsonl" 2> "$OUT/$shape-steps.err"
    tail -1 "$OUT/$shape-steps.jsonl"; grep -v -i warn "$OUT/$shape-steps.err" | tail -3 | cut -c 1-300
  done
else
  timeout ${2:-200} python3 -m pytest -x -q -p no:cacheprovider tests/core/test_static_decoding.py tests/core/test_chunked_attention.py \
    2>&1 | tail -15
fi
