# Issue 23 item 3 on the GPU machine (device tool), from the repository root, carrying .whl:
#   bash docs/results/step_floor_gpu.sh [bf16|int4]
# 7B-shaped random-weight steps (scripts/time_graph_steps.py, CUDA graphs, 1,000-token context),
# eager regions against compiled ones (CausalLM.compile_layers); results under $OUT.
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
what=${1:-bf16}
for shape in vicuna-7b llama-3-8b; do
  if [ "$what" = bf16 ]; then
    for flag in "" --compile; do
      timeout 200 python3 scripts/time_graph_steps.py --shape $shape --dtype bf16 --modes graphs \
        --trees single,medusa-64 --steps 100 $flag > "$OUT/$shape-bf16$flag.jsonl" 2> "$OUT/$shape-bf16$flag.err"
      tail -1 "$OUT/$shape-bf16$flag.jsonl"; tail -2 "$OUT/$shape-bf16$flag.err" | cut -c 1-300
    done
  else
    timeout 200 python3 scripts/time_graph_steps.py --shape $shape --dtype int4 --modes graphs \
      --trees single,medusa-64 --steps 100 > "$OUT/$shape-int4.jsonl" 2> "$OUT/$shape-int4.err"
    tail -1 "$OUT/$shape-int4.jsonl"; tail -2 "$OUT/$shape-int4.err" | cut -c 1-300
  fi
done
