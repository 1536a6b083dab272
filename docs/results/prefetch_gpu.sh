# Issue 23, session 32: L2 asks before a kernel's dependent-launch wait (token_layer.Launch.tile_prefetch),
# on the GPU machine (device tool), from the repository root, carrying .whl_lite.
#   bash docs/results/prefetch_gpu.sh [steps|small|levers|matmuls|exact]
#   steps: a compile check (probe_step with the asks on, against the regions), then whole graph steps of
#          SHAPE (vicuna-7b), 1,000-token context, plain, a 64-node chain (lookup-63: the tree's own cost,
#          drafting ~free) and medusa-64 (random hydra heads), the asks off and on (-pf:COLS a weight row),
#          the norm inside the tiles (-innernorm), alternating in one process
#   small: the default model's shape (shipped heads), context 900, REGIONS (the code's default and the asks)
#   levers: steps with the levers not yet timed (Launch.attention_partials16, large_qkv_n), off in the code
#   matmuls: scripts/time_layer_matmuls.py: each matmul's tiles against its one-token kernel, by LAUNCHES
#   exact: the layer kernels', the attention's and the step's tests on the GPU
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
case "${1:-steps}" in
steps)
  timeout 60 python3 - <<'PY' 2>&1 | tail -6 | tee "$OUT/compile_check.txt"
import torch
from specmemo_core.runtime import token_layer
launch = token_layer.Launch(tile_prefetch=512, row_tiles=True)
for dtype in (torch.bfloat16, torch.float32):
    got = token_layer.probe_step(torch.device("cuda"), dtype, kernels=True, launch=launch)
    want = token_layer.probe_step(torch.device("cuda"), dtype, kernels=False)
    print(dtype, "max abs diff", max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want)))
PY
  timeout ${2:-420} python3 scripts/time_graph_steps.py --shape ${SHAPE:-vicuna-7b} --dtype bf16 --draft-vocab 8192 \
    --steps 40 --repeats ${REPEATS:-3} --trees ${TREES:-single,lookup-63,medusa-64} \
    --regions "${REGIONS:-compiled,compiled-pf:256,compiled-pf:512,compiled-pf:1024,compiled-pf:2048,compiled-innernorm}" \
    > "$OUT/${SHAPE:-vicuna-7b}.jsonl" 2> "$OUT/${SHAPE:-vicuna-7b}.err"
  echo "steps rc=$?"; grep -v '"shape"' "$OUT/${SHAPE:-vicuna-7b}.jsonl" | cut -c 1-160; tail -3 "$OUT/${SHAPE:-vicuna-7b}.err" ;;
small)  # the default model's shape with the shipped heads, context 900
  timeout ${2:-150} python3 scripts/time_graph_steps.py --shape smollm2-135m --dtype bf16 --heads assets/heads/SmolLM2-135M-Instruct \
    --steps 100 --repeats 3 --context 900 --trees ${TREES:-single,calibrated-12+lookup-8,medusa-64} \
    --regions "${REGIONS:-compiled,compiled-pf:512}" > "$OUT/smollm2-135m.jsonl" 2> "$OUT/smollm2-135m.err"
  echo "small rc=$?"; grep -v '"shape"' "$OUT/smollm2-135m.jsonl" | cut -c 1-150 ;;
levers)  # session 32's untimed levers (off in the code): 16-bit attention partials, narrower q/k/v tiles
  REGIONS='compiled,compiled{attention_partials16=1},compiled{large_qkv_n=16},compiled{large_tile_n=16;large_qkv_n=32},compiled{attention_partials16=1;large_qkv_n=16}' \
    TREES=${TREES:-single,lookup-63} bash "$0" steps ${2:-300} ;;
matmuls)  # each of a layer's four matmul kernels, tiles (64 tokens) against the one-token kernels, 32-layer chains
  for L in ${LAUNCHES:-- tile_prefetch=0 large_qkv_n=16 large_tile_n=16}; do  # -: the code's default
    [ "$L" = - ] && L=""
    timeout 100 python3 scripts/time_layer_matmuls.py --shape ${SHAPE:-vicuna-7b} --launch "$L" >> "$OUT/matmuls.jsonl" \
      2>> "$OUT/matmuls.err"
  done; cut -c 1-200 "$OUT/matmuls.jsonl" ;;
exact)
  timeout ${2:-200} python3 -m pytest -q -p no:cacheprovider tests/core/test_token_layer.py \
    tests/core/test_chunked_attention.py tests/core/test_step_kernels.py tests/core/test_static_decoding.py \
    tests/core/test_growth.py > "$OUT/exact.log" 2>&1; tail -2 "$OUT/exact.log" ;;
esac
