# Issues 22 and 23, session 26: the step's glue kernels (specmemo_core/runtime/step_kernels.py:
# the drafting top-k, the greedy path, the accepted entries' move) on the GPU machine (device
# tool), from the repository root, carrying .whl. Results: step_glue_h100/ (FILES.md there).
#   bash docs/results/step_glue_gpu.sh [exact|steps|vicuna|profile]
#   exact:   the kernels' tests, the static decoder's and the layer kernels' on the GPU
#   steps:   whole graph steps of the default model's shape with the shipped heads, the glue
#            kernels on (compiled) and off (compiled-noglue), the heads' context layer through
#            token_layer's kernels or its regions (-ctxregions), 3 rounds alternating in one process
#   vicuna:  the same for vicuna-7b's shape, random hydra heads drafting over 8,192 tokens, 2 rounds
#   profile: one eager step of each tree under the profiler: kernels and GPU µs by phase
#   bench:   specmemo bench bf16, 20 MT-Bench queries, the shipped heads, the glue kernels on and
#            off (SPECMEMO_STEP_KERNELS=0), one process after the other (needs the GGUF: gpu_setup.sh)
#   fp32:    specmemo bench fp32, the kernels on, 1 round: every reply against plain greedy's
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
HEADS=assets/heads/SmolLM2-135M-Instruct
case "${1:-steps}" in
exact)
  timeout ${2:-200} python3 -m pytest -q -p no:cacheprovider tests/core/test_step_kernels.py tests/core/test_static_decoding.py \
    tests/core/test_token_layer.py tests/core/test_growth.py > "$OUT/exact.log" 2>&1
  tail -3 "$OUT/exact.log" ;;
steps)
  timeout ${2:-240} python3 scripts/time_graph_steps.py --shape smollm2-135m --dtype bf16 --heads $HEADS --steps 100 \
    --repeats 3 --trees medusa-64,1-10-16-17+lookup-8,dynamic-16+lookup-8 --regions ${REGIONS:-compiled,compiled-noglue} \
    > "$OUT/smollm2-135m-glue.jsonl" 2> "$OUT/smollm2-135m-glue.err"
  grep -v '"shape"' "$OUT/smollm2-135m-glue.jsonl"; tail -2 "$OUT/smollm2-135m-glue.err" | cut -c 1-300 ;;
vicuna)
  timeout ${2:-200} python3 scripts/time_graph_steps.py --shape vicuna-7b --dtype bf16 --draft-vocab 8192 --steps 40 \
    --repeats 2 --trees ${TREES:-medusa-64} --regions ${REGIONS:-compiled,compiled-noglue} > "$OUT/vicuna-7b-glue.jsonl" 2> "$OUT/vicuna-7b-glue.err"
  grep -v '"shape"' "$OUT/vicuna-7b-glue.jsonl"; tail -2 "$OUT/vicuna-7b-glue.err" | cut -c 1-300 ;;
profile)
  timeout ${2:-150} python3 scripts/time_graph_steps.py --shape smollm2-135m --dtype bf16 --heads $HEADS --steps 50 \
    --trees ${TREES:-single,medusa-64,1-10-16-17+lookup-8} --modes graphs --kernels > "$OUT/profile-smollm2-135m.jsonl" \
    2> "$OUT/profile-smollm2-135m.err"
  python3 scripts/show_step_profile.py "$OUT/profile-smollm2-135m.jsonl"
  ;;
bench)
  for glue in 1 0; do
    name=bench_mtbench20_bf16_glue$glue
    SPECMEMO_STEP_KERNELS=$glue timeout ${2:-250} python3 -m specmemo_core.cli bench --device cuda --dtype bf16 \
      --methods vanilla+graphs,medusa-64+graphs,plan --queries 20 --max-new-tokens 128 --repeats 3 --warmup 1 --json \
      --save "$OUT/$name.json" > /dev/null 2> "$OUT/$name.err"
    echo "$name rc=$?"; grep -i "tok/s\|plan\|chose" "$OUT/$name.err" | tail -6 | cut -c 1-250
  done ;;
fp32)
  timeout ${2:-200} python3 -m specmemo_core.cli bench --device cuda --dtype fp32 \
    --methods vanilla+graphs,medusa-64+graphs,plan --queries 20 --max-new-tokens 128 --repeats 1 --warmup 0 --json \
    --save "$OUT/bench_mtbench20_fp32_glue1.json" > /dev/null 2> "$OUT/bench_mtbench20_fp32_glue1.err"
  echo "rc=$?"; python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(m, d[m]['tree'], d[m]['identical_to_vanilla'], d[m]['replies'], d[m]['tokens_per_s']['median']) for m in d if m[0] != '_']" "$OUT/bench_mtbench20_fp32_glue1.json" ;;
esac
