# Issue 22, session 35: issue 22's benches on the GPU machine (device tool) with the longer lookup chains
# (session 34: docs/results/lookup_long_cpu/): the planner's pick (dynamic-32+lookup-32 by the walk),
# dynamic-24+lookup-40 (session 35's best 64-node split on the CPU by the old count, 4.03 accepted a step;
# 3.64 tokens per step as the replies got them: docs/results/reply_tokens_cpu/) and dynamic-48+lookup-64
# (112 nodes, past the cap; on the default model past the fused attention's 256 rows too), against
# vanilla+graphs, on the 20 MT-Bench queries, the 30 mixed and the 20 code prompts, bf16 then fp32 (every reply against
# plain greedy's), 128 new tokens, 1 warm-up and 3 timed rounds in one process a workload.
# Needs the GGUF: a call carrying .gguf1 (any of this folder's scripts: gpu_setup.sh copies it to /tmp)
# made just before, then this one carrying .whl_lite and .gguf2.
#   bash docs/results/chains_gpu.sh [bf16|fp32|both] [SECONDS a bench]
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -s /tmp/smdata/models/SmolLM2-135M-Instruct.Q4_1.gguf ] || { echo "no GGUF: carry .gguf1 in the call before"; exit 1; }
METHODS=${METHODS:-vanilla+graphs,plan,dynamic-24+lookup-40+graphs,dynamic-48+lookup-64+graphs}
bench() {  # DTYPE NAME PROMPTS QUERIES
  timeout ${SECONDS_A_BENCH:-90} python3 -m specmemo_core.cli bench --device cuda --dtype $1 --methods $METHODS \
    ${3:+--prompts $3} --queries $4 --max-new-tokens 128 --repeats 3 --warmup 1 --json \
    --save "$OUT/bench_$2_$1.json" > /dev/null 2> "$OUT/bench_$2_$1.err"
  echo "$2 $1 rc=$?"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print(' ', m, d[m].get('tree'), d[m].get('identical_to_vanilla'), d[m].get('tokens_per_step'), d[m].get('mean_accepted'), d[m]['tokens_per_s'], d[m].get('vs_vanilla+graphs')) for m in d if m[0] != '_']" \
    "$OUT/bench_$2_$1.json" 2>&1 | cut -c 1-300
}
SECONDS_A_BENCH=${2:-90}
nvidia-smi --query-gpu=name --format=csv,noheader > "$OUT/gpu.txt"; cat "$OUT/gpu.txt"
for DT in $( [ "${1:-both}" = both ] && echo bf16 fp32 || echo $1 ); do
  bench $DT mtbench20 "" 20
  bench $DT mixed30 assets/prompts/bench_mixed.jsonl 30
  bench $DT code20 assets/prompts/bench_code.jsonl 20
done
