# Issue 23, session 33: a 7B layer's q/k/v tiles (192 programs: 1.45 waves of an H100's 132 SMs at one
# program an SM) at fewer stages, so two programs share an SM and all run at once
# (token_layer.Launch.large_qkv_stages, large_tile_stages), on the GPU machine (device tool), from the
# repository root, carrying .whl_lite. Session 34's three calls (steps, attention, matmuls) are in
# docs/results/waves_h100/ (FILES.md); its defaults since (q/k/v at 3 stages, endings early) and the
# attention's stages and chunk (Launch.attention_stages, attention_split) ran in session 35 (steps3/,
# split3/, on H100s: neither attention lever taken); `close` as a whole, llama-3-8b's steps, not yet run.
#   bash docs/results/waves_gpu.sh [matmuls|steps|attention|profile|exact|close]
#   matmuls: prefetch_gpu.sh's (each matmul's tiles against its one-token kernel) by LAUNCHES, then the
#            code's at TOKENS (16, 32) tokens
#   steps: prefetch_gpu.sh's whole graph steps of SHAPE (vicuna-7b), plain and a 64-node chain
#          (lookup-63), REGIONS alternating in one process (and the tiles' endings' inputs read before
#          their loops: Launch.tile_early_ending)
#   attention: the attention alone, variants V (scripts/time_step_parts.py: SPLIT:WARPS:STAGES:MERGE_ROWS[:p16][:mROWS])
#   profile: large_tiles_gpu.sh's (one eager step of plain and lookup-63 under the profiler)
#   exact: prefetch_gpu.sh's (the layer kernels', attention's, step kernels' and static decoder's tests)
#   close: steps, llama-3-8b's steps (the defaults against the old) and exact, in one call
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# (a default holding braces set apart: bash's ${VAR:-…} ends at the first closing brace)
# (session 34: the code's defaults now q/k/v at 3 stages and the endings early; against the old ones
# and the attention at one stage)
STEP_REGIONS='compiled,compiled{large_qkv_stages=6;tile_early_ending=0},compiled{attention_stages=1},compiled{attention_split=192}'
case "${1:-steps}" in
matmuls)  # prefetch_gpu.sh's, by these launches (the code's, then its old defaults and others), then the code's at TOKENS tokens
  LAUNCHES=${LAUNCHES:-"- large_qkv_stages=6 tile_early_ending=0 large_qkv_stages=2 large_tile_stages=3"} \
    bash docs/results/prefetch_gpu.sh matmuls
  for T in ${TOKENS:-16 32}; do  # fewer tokens a tile: its x read from L2 for each weight byte shrinks
    timeout 100 python3 scripts/time_layer_matmuls.py --shape ${SHAPE:-vicuna-7b} --tokens $T >> "$OUT/matmuls.jsonl" \
      2>> "$OUT/matmuls.err"
  done; cut -c 1-170 "$OUT/matmuls.jsonl" ;;
steps)  # prefetch_gpu.sh's (its compile check, then the steps) with these regions
  REGIONS=${REGIONS:-$STEP_REGIONS} TREES=${TREES:-single,lookup-63} bash docs/results/prefetch_gpu.sh steps ${2:-300} ;;
attention)  # the attention alone (32 layers, a 64-node tree), the step's span at 1,000 slots (2,048) and at 960 (1,024)
  for CS in 1000:2048 960:1024; do
    PYTHONPATH=$PYTHONPATH:scripts timeout 100 python3 scripts/time_step_parts.py --shape ${SHAPE:-vicuna-7b} \
      --parts attention --no-others --context ${CS%:*} --span ${CS#*:} \
      --variants ${V:-192:4:auto:8:p16,192:4:1:8:p16,64:4:1:8:p16,128:4:auto:8:p16,64:4:auto:8:p16,256:4:auto:8:p16,128:4:1:8:p16,128:4:3:8:p16,128:4:auto:8:p16:m32,128:8:auto:8:p16} \
      >> "$OUT/attention.jsonl" 2>> "$OUT/attention.err"
  done; grep -v 'max_abs' "$OUT/attention.jsonl" | cut -c 1-400 ;;
profile)  # large_tiles_gpu.sh's, plain against the 64-node chain
  TREES=${TREES:-single,lookup-63} bash docs/results/large_tiles_gpu.sh profile ${2:-150} ;;
exact)
  bash docs/results/prefetch_gpu.sh exact ${2:-250} ;;
close)  # issue 23's last item in one call (~560 s): both shapes' steps with the code's defaults, then its GPU tests
  timeout 170 bash "$0" steps 160
  SHAPE=llama-3-8b REGIONS='compiled,compiled{large_qkv_stages=6;tile_early_ending=0}' timeout 130 bash "$0" steps 120 \
    2>&1 | tail -4
  timeout 250 bash "$0" exact 240 2>&1 | tail -15 ;;
esac
