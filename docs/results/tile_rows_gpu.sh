# Issue 23, session 25: token_layer's tile kernels for steps of several tokens (5 stages, BLOCK_K
# 128 for K ≥ 1,024) on the GPU machine (device tool), from the repository root, carrying .whl
# (bench: and the GGUF as gpu_setup.sh says). Results: tile_rows_h100/ (FILES.md there).
#   bash docs/results/tile_rows_gpu.sh [steps|tune|exact|bench|vicuna]
#   steps:  whole graph steps of the default model's shape (time_graph_steps.py), tiles
#           (compiled#tile_n:tile_k:warps:stages) against cuBLAS and the regions (compiled-notiles),
#           3 rounds alternating
#   tune:   the same around tile_n 16
#   exact:  the GPU tests of token_layer (the tiles against the regions, greedy decoding alike)
#   bench:  specmemo bench bf16, 20 MT-Bench queries, the code as it is (tiles by default for the
#           default model) and a copy whose Launch.row_tiles default is False, one after the other
#   vicuna: the steps for vicuna-7b's shape (where the default keeps cuBLAS)
#   tile_m: session 26: tokens a tile program takes (compiled#N:K:W:S:M), 16 and 32 against the auto 64
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps() {  # shape trees regions name timeout [steps repeats]
  timeout $5 python3 scripts/time_graph_steps.py --shape $1 --dtype bf16 --trees $2 --steps ${6:-100} --repeats ${7:-3} \
    --draft-vocab 8192 --regions $3 > "$OUT/$4.jsonl" 2> "$OUT/$4.err"
  cut -c 1-300 "$OUT/$4.jsonl"; tail -2 "$OUT/$4.err" | cut -c 1-300
}
case "${1:-steps}" in
steps) steps smollm2-135m 1-10-16-17,medusa-64 compiled-notiles,compiled#32:0:4:5,compiled#16:0:4:5 smollm2-135m-tiles 200 ;;
tune) steps smollm2-135m medusa-64,1-10-16-17 \
  compiled-notiles,compiled#16:0:4:5,compiled#16:0:2:5,compiled#16:0:4:4,compiled#16:128:4:5,compiled#16:64:2:6 \
  smollm2-135m-tiles16 100 ;;
exact)
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/core/test_token_layer.py > "$OUT/exact_token_layer.log" 2>&1
  tail -2 "$OUT/exact_token_layer.log" ;;
bench)
  rm -rf /tmp/notiles && mkdir -p /tmp/notiles && cp -r specmemo_core /tmp/notiles/ && ln -sfn "$PWD/assets" /tmp/notiles/assets
  sed -i 's/    row_tiles: bool | None = None/    row_tiles: bool | None = False/' /tmp/notiles/specmemo_core/runtime/token_layer.py
  for methods in vanilla+graphs,plan medusa-64+graphs; do
    for variant in tiles notiles; do
      where=$PWD; [ $variant = notiles ] && where=/tmp/notiles
      name=bench_mtbench20_bf16$([ $methods = medusa-64+graphs ] && echo _medusa64)_$variant
      (cd $where && PYTHONPATH=/tmp/site:$where timeout 170 python3 -m specmemo_core.cli bench --device cuda --dtype bf16 \
        --methods $methods --queries 20 --max-new-tokens 128 --repeats 3 --warmup 1 --json --save "$OUT/$name.json" \
        > /dev/null 2> "$OUT/$name.err")
      echo "$name rc=$?"
    done
  done ;;
tile_m) steps smollm2-135m medusa-64,1-10-16-17 \
  compiled#16:0:4:5,compiled#16:0:4:5:16,compiled#16:0:4:5:32,compiled#32:0:4:5:16,compiled#16:0:2:5:16,compiled#16:64:4:4:16 \
  smollm2-135m-tile-m 150 ;;
vicuna) steps vicuna-7b medusa-64 compiled-notiles,compiled#16:0:4:5 vicuna-7b-tiles 100 40 2 ;;
esac
