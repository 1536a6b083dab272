# Issue 23, session 25: token_layer's tile kernels for steps of several tokens (5 stages, BLOCK_K
# 128 for K ≥ 1,024) on the GPU machine (device tool), from the repository root, carrying .whl:
#   bash docs/results/tile_rows_gpu.sh [steps|exact|vicuna]
#   steps:  whole graph steps of the default model's shape (time_graph_steps.py), tiles
#           (compiled#tile_n:tile_k:warps:stages) against cuBLAS and the regions (compiled-notiles),
#           3 rounds alternating
#   exact:  the GPU tests of token_layer (the tiles against the regions, greedy decoding alike)
#   vicuna: the same steps for vicuna-7b's shape (where the default keeps cuBLAS)
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-steps}" in
steps)
  timeout ${2:-180} python3 scripts/time_graph_steps.py --shape smollm2-135m --dtype bf16 --trees 1-10-16-17,medusa-64 \
    --steps 100 --repeats 3 --draft-vocab 8192 --regions compiled-notiles,compiled#32:0:4:5,compiled#16:0:4:5 \
    > "$OUT/smollm2-135m-tiles.jsonl" 2> "$OUT/smollm2-135m-tiles.err"
  cat "$OUT/smollm2-135m-tiles.jsonl" | cut -c 1-400; tail -2 "$OUT/smollm2-135m-tiles.err" | cut -c 1-300 ;;
exact)
  timeout ${2:-90} python3 -m pytest -q -p no:cacheprovider tests/core/test_token_layer.py > "$OUT/exact_token_layer.log" 2>&1
  tail -2 "$OUT/exact_token_layer.log" ;;
vicuna)
  timeout ${2:-100} python3 scripts/time_graph_steps.py --shape vicuna-7b --dtype bf16 --trees medusa-64 \
    --steps 40 --repeats 2 --regions compiled-notiles,compiled#32:0:4:5 \
    > "$OUT/vicuna-7b-tiles.jsonl" 2> "$OUT/vicuna-7b-tiles.err"
  cat "$OUT/vicuna-7b-tiles.jsonl" | cut -c 1-400; tail -2 "$OUT/vicuna-7b-tiles.err" | cut -c 1-300 ;;
esac
