#!/usr/bin/env bash
# Issue 22 on one H200: the heads that ship with the default model, retrained with a context layer
# that reads the next token (train-heads --context-next) on the 8,000 shipped training prompts,
# calibrated in fp32, and the benches of the three workloads run with them. Device calls made back
# to back (the machine keeps /tmp between them):
#   copy    (carry .gguf1)         the GGUF's first part to /tmp
#   train   (carry .gguf2 .whl)    joins the GGUF; distills 8,000 replies, trains 4,000 steps (a run cut
#                                  by the timeout resumes in the next call from its checkpoint)
#   calib   (carry .whl)           finishes the training if cut; calibrates a copy in fp32 on the held-out
#                                  mix as the shipped heads are calibrated; eval-acceptance on 20 MT-Bench
#                                  queries (fp32); heads, calibration and card come back in $OUT
#   bench DTYPE [WORKLOADS] (carry .whl; the new heads now in assets/heads/)  `specmemo bench` on the 20 MT-Bench
#                                  queries, the 30 mixed prompts and the 20 code prompts
#                                  (assets/prompts/bench_*.jsonl), 1 warm-up + 3 timed rounds each
# Run from the repository root with $OUT set:  bash docs/results/heads_ship_gpu.sh copy|train|calib|bench bf16
source scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
TRAIN=/tmp/ship CAL=/tmp/shipcal
train() {
  timeout "$1" python3 -m specmemo_core.cli train-heads --model default --out $TRAIN --kind hydra --layers 1 \
    --context-layer --context-next --prompts 8000 --steps 4000 --prompts-file assets/prompts/heads_training.jsonl.gz \
    --heldout-file assets/prompts/heads_heldout.jsonl.gz --heldout-prompts 400 --reply-tokens 256 --gen-batch 512 \
    --device cuda > "$OUT/card_stdout.json" 2> "$OUT/train.err"
  echo "train rc=$?"; grep -v -i warn "$OUT/train.err" | grep -v "^\s*$" | tail -n 8
}
case "$1" in
copy) ls -la /tmp/part_aa ;;
train) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"; train 520 ;;
calib)
  [ -f $TRAIN/card.json ] || train 300
  mkdir -p $CAL && cp $TRAIN/heads.safetensors $TRAIN/card.json $CAL/
  timeout 200 python3 -m specmemo_core.cli calibrate --heads $CAL --dtype fp32 --device cuda \
    --heldout-file assets/prompts/heads_heldout.jsonl.gz --heldout-prompts 400 --reply-tokens 128 --gen-batch 32 \
    > "$OUT/calibrate.json" 2> "$OUT/calibrate.err"
  echo "calibrate rc=$?"; head -c 1200 "$OUT/calibrate.json"
  cp $CAL/heads.safetensors $CAL/calibration.json $CAL/card.json "$OUT/"
  timeout 150 python3 -m specmemo_core.cli eval-acceptance --heads $CAL --device cuda --dtype fp32 --queries 20 \
    --max-new-tokens 128 --tree calibrated-48+lookup-8 --tree dynamic-48+lookup-8 --tree medusa-64 --json \
    > "$OUT/eval_mtbench20_fp32.json" 2> "$OUT/eval.err"
  echo "eval rc=$?"; head -c 1500 "$OUT/eval_mtbench20_fp32.json" ;;
bench)
  M=vanilla+graphs,medusa-64+graphs,plan
  for w in $(echo "${3:-mtbench20,mixed,code}" | tr , ' '); do
    case $w in
      mixed) P="--prompts assets/prompts/bench_mixed.jsonl --queries 30" ;;
      code) P="--prompts assets/prompts/bench_code.jsonl --queries 20" ;;
      *) P="--queries 20" ;;
    esac
    timeout 175 python3 -m specmemo_core.cli bench --device cuda --dtype "$2" --methods "$M" $P \
      --max-new-tokens 128 --repeats 3 --warmup 1 --json --save "$OUT/bench_${w}_$2.json" > /dev/null \
      2> "$OUT/bench_${w}_$2.err"
    echo "$w rc=$?"; grep -v -i warn "$OUT/bench_${w}_$2.err" | tail -n 6
  done ;;
benches) for d in ${2//,/ }; do bash "$0" bench "$d" "$3"; done ;;
*) echo "usage: bash docs/results/heads_ship_gpu.sh copy|train|calib|bench bf16|fp32"; exit 2 ;;
esac
