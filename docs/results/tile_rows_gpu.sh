# Issue 23, session 25: token_layer's tile kernels for steps of several tokens (5 stages, BLOCK_K
# 128 for K ≥ 1,024) on the GPU machine (device tool), from the repository root, carrying .whl
# (and for bench the GGUF as gpu_setup.sh says):  bash docs/results/tile_rows_gpu.sh [steps|bench]
#   steps: the GPU tests of token_layer, then whole graph steps (time_graph_steps.py), tiles
#          (compiled#tile_n:tile_k:warps:stages) against cuBLAS and the regions (compiled-notiles),
#          3 rounds alternating, the default model's shape and vicuna-7b's
#   bench: specmemo bench bf16 on the 20 MT-Bench queries, the code as it is (tiles by default for
#          the default model) and a copy whose Launch.row_tiles default is False, one after the other
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-steps}" in
steps)
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/core/test_token_layer.py > "$OUT/exact_token_layer.log" 2>&1
  tail -2 "$OUT/exact_token_layer.log"
  timeout 200 python3 scripts/time_graph_steps.py --shape smollm2-135m --dtype bf16 --trees single,1-10-16-17,medusa-64 \
    --steps 100 --repeats 3 --regions compiled-notiles,compiled#32:0:4:5,compiled#16:0:4:5,compiled#64:0:4:5 \
    > "$OUT/smollm2-135m-tiles.jsonl" 2> "$OUT/smollm2-135m-tiles.err"
  tail -2 "$OUT/smollm2-135m-tiles.err" | cut -c 1-300
  timeout 100 python3 scripts/time_graph_steps.py --shape vicuna-7b --dtype bf16 --trees medusa-64 \
    --steps 40 --repeats 2 --regions compiled-notiles,compiled#32:0:4:5 \
    > "$OUT/vicuna-7b-tiles.jsonl" 2> "$OUT/vicuna-7b-tiles.err"
  tail -2 "$OUT/vicuna-7b-tiles.err" | cut -c 1-300 ;;
bench)
  rm -rf /tmp/notiles && mkdir /tmp/notiles && cp -r specmemo_core /tmp/notiles/
  sed -i 's/    row_tiles: bool | None = None/    row_tiles: bool | None = False/' /tmp/notiles/specmemo_core/runtime/token_layer.py
  grep -c "row_tiles: bool | None = False" /tmp/notiles/specmemo_core/runtime/token_layer.py
  for variant in tiles notiles; do
    where=.; [ $variant = notiles ] && where=/tmp/notiles
    (cd $where && PYTHONPATH=/tmp/site:. timeout 170 python3 -m specmemo_core.cli bench --device cuda --dtype bf16 \
      --methods vanilla+graphs,medusa-64+graphs,plan --queries 20 --max-new-tokens 128 --repeats 3 --warmup 1 --json \
      --save "$OUT/bench_mtbench20_bf16_$variant.json" > /dev/null 2> "$OUT/bench_mtbench20_bf16_$variant.err")
    echo "$variant rc=$?"; tail -1 "$OUT/bench_mtbench20_bf16_$variant.err" | cut -c 1-300
  done ;;
esac
