# Issue 23 item 3 on the GPU machine (device tool), from the repository root, carrying .whl:
#   bash docs/results/step_floor_gpu.sh [bf16|int4|one-token]
# 7B-shaped random-weight steps (scripts/time_graph_steps.py, CUDA graphs, 1,000-token context):
# bf16 with eager and compiled layer regions (CausalLM.compile_layers) alternating in one process,
# 3 rounds each; int4 (torchao) eager. Results under $OUT.
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
what=${1:-bf16}
if [ "$what" = one-token ]; then  # plain steps: one-token regions compiled for their own shape, and autotuned
  for shape in vicuna-7b llama-3-8b; do
    timeout 280 python3 scripts/time_graph_steps.py --shape $shape --dtype bf16 --trees single --steps 100 \
      --regions compiled,static1,autotune1 --repeats 3 > "$OUT/$shape-one-token.jsonl" 2> "$OUT/$shape-one-token.err"
    tail -1 "$OUT/$shape-one-token.jsonl"; grep -v -i warn "$OUT/$shape-one-token.err" | tail -2 | cut -c 1-300
  done
  exit 0
fi
shapes="vicuna-7b llama-3-8b"; [ "$what" = bf16 ] && shapes="$shapes smollm2-135m"
for shape in $shapes; do
  if [ "$what" = bf16 ]; then
    timeout 240 python3 scripts/time_graph_steps.py --shape $shape --dtype bf16 --trees single,medusa-64 \
      --steps 100 --regions eager,compiled --repeats 3 > "$OUT/$shape-bf16.jsonl" 2> "$OUT/$shape-bf16.err"
  else
    timeout 200 python3 scripts/time_graph_steps.py --shape $shape --dtype int4 --modes graphs \
      --trees single,medusa-64 --steps 100 > "$OUT/$shape-int4.jsonl" 2> "$OUT/$shape-int4.err"
  fi
  tail -1 "$OUT/$shape-$what.jsonl"; tail -2 "$OUT/$shape-$what.err" | cut -c 1-300
done
