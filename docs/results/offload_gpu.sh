#!/usr/bin/env bash
# Issue 19 (models larger than the GPU) on one H200, in device calls of under 10 minutes, each
# made at once after the last (the machine keeps /tmp ~30 s between calls):
#
#   copy     puts the first GGUF part (carried in .gguf1) in place; the next call carries .gguf2.
#   start    specmemo bench's offload methods on the default model, in one process, with the
#            GPU capped so that at most half its decoder layers fit (--cap-gib half): 20 MT-Bench
#            queries, 128 new tokens, 3 timed rounds, saved after each round (~19 min: accelerate
#            alone ~210 s a round). It runs in its own process session, so it outlives the call,
#            which waits ~9 min; then
#   collect  waits for it to finish (or ~9.5 min; call it again if it has not) and copies its
#            files to $OUT.
#   call2    specmemo plan --verify for three plans that stream layers (random weights of the
#            real shapes), 20 turns of 16 reply tokens each, then the layer-streaming probe.
#            Estimated 5 min; the timeouts add up to 8.5 min.
#   short    (after `copy`) the bench's methods on 8 queries of 64 new tokens, 3 rounds in one call.
#
# Run from the repository root with $OUT set:  bash docs/results/offload_gpu.sh copy, then start,
# then collect (bench), and copy then call2 (verify); here, with the calls' files:
#   python3 scripts/collect_offload_results.py OUT_OF_COLLECT OUT_OF_CALL2 --readme
set -x
source scripts/gpu_setup.sh
export PYTHONPATH=/tmp/site:.
# accelerate (the baseline) and psutil (free RAM) are dependencies; wheels in .whl/ if the box lacks them
python3 -c "import accelerate, psutil" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
  --target /tmp/site .whl/accelerate-*.whl .whl/psutil-*.whl
GGUF=/tmp/smdata/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -s "$GGUF" ] && [ -f .gguf1/part_aa ] && [ -f .gguf2/part_ab ]; then cat .gguf1/part_aa .gguf2/part_ab > "$GGUF"; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu_$1.txt"
free -g >> "$OUT/gpu_$1.txt"
python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)" >> "$OUT/gpu_$1.txt"

bench_offload() {  # name timeout_s queries new_tokens: the four methods in one process, 3 rounds
  local name=$1
  timeout "$2" python3 -m specmemo_core.cli bench --device cuda --dtype bf16 \
    --methods accelerate-offload,stream-plain,stream-tree,stream-random-heads --cap-gib half \
    --queries "$3" --max-new-tokens "$4" --repeats 3 --warmup 0 --json --save "$OUT/$name.json" \
    > "$OUT/${name}_stdout.json" 2> "$OUT/$name.err"
  echo "bench rc=$?"; tail -c 1500 "$OUT/$name.err"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(json.dumps(d['_offload'], indent=1)); print(d['_run']['rounds_done'])" "$OUT/$name.json"
}

case "$1" in
call2)
  verify() {  # name timeout_s plan-args...
    local name=$1 limit=$2; shift 2
    timeout "$limit" python3 -m specmemo_core.cli plan --device cuda --turns 20 --reply-tokens 16 --prefer speed \
      --verify --json "$@" > "$OUT/verify_$name.json" 2> "$OUT/verify_$name.err"
    echo "$name rc=$?"; tail -c 800 "$OUT/verify_$name.json"; tail -3 "$OUT/verify_$name.err"
  }
  verify vicuna-7b-bf16-8gb 130 --model shape:vicuna-7b --dtype bf16 --vram 8
  verify vicuna-13b-int8-12gb 150 --model shape:vicuna-13b --dtype int8 --vram 12
  verify llama-3-8b-bf16-8gb 170 --model shape:llama-3-8b --dtype bf16 --vram 8
  timeout 60 python3 -m specmemo_core.tools.offload_probe --model default --dtype bf16 --resident 15 \
    --sizes 1,16,64 --repeats 5 > "$OUT/probe_default_r15.json" 2> "$OUT/probe.err"
  echo "probe rc=$?"; cat "$OUT/probe_default_r15.json"
  ;;
short)
  # the same four methods on a shorter workload (8 MT-Bench queries, 64 new tokens), so that 3
  # rounds fit one call: checks the random-heads control (heads' nodes only, no lookup chain)
  bench_offload bench_offload_short 400 8 64 ;;
start)
  mkdir -p /tmp/offload_full
  OUT=/tmp/offload_full setsid nohup bash -c "$(declare -f bench_offload); bench_offload bench_offload 1500 20 128; touch /tmp/offload_full/done" \
    > /tmp/offload_full/driver.log 2>&1 < /dev/null &
  for _ in $(seq 54); do sleep 10; [ -f /tmp/offload_full/done ] && break; done
  python3 -c "import json; print(json.load(open('/tmp/offload_full/bench_offload.json'))['_run'])" 2>/dev/null
  tail -c 600 /tmp/offload_full/bench_offload.err ;;
collect)
  for _ in $(seq 56); do [ -f /tmp/offload_full/done ] && break; sleep 10; done
  cp /tmp/offload_full/* "$OUT"/; cat "$OUT/driver.log" | tail -40 ;;
copy)
  echo "part copied to /tmp"; ls -la /tmp/part_aa ;;
*)
  echo "usage: bash docs/results/offload_gpu.sh copy|start|collect|call2|short"; exit 2 ;;
esac
