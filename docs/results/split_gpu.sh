#!/usr/bin/env bash
# Issue 24 (several GPUs: split the layers) on a machine with one or two CUDA GPUs, in two
# device calls of under 9 minutes each:
#
#   call1  1. the CUDA cases of tests/core/test_split.py: a tiny model split in two on one card
#             (cuda:0,cuda:0) and, with two cards, over both (cuda:0,cuda:1), greedy == one card's;
#          2. tools/split_check on the default model with its shipped heads, bf16: split evenly
#             over cuda:0,cuda:1 (two cards) or cuda:0,cuda:0 (one card: two segments, captured
#             as CUDA graphs), 16 MT-Bench first turns as requests, 128 new tokens, batch 1 and
#             batch 8, plain and speculative (the planner's tree per batch size), 3 timed rounds
#             on the split model (median, min-max) and one round of the whole model on cuda:0 to
#             compare every reply token for token. Estimated 4-7 min (eager steps across two
#             cards; graph replays on one).
#   call2  (two cards only) specmemo plan --verify for vicuna-13b in bf16 with each card capped
#          at 16 GiB, split over both: random weights made on each card, 20 turns (32 reply
#          tokens each, the cache filled to its planned size first), each card's measured peak
#          against its predicted bytes. Estimated 3-5 min.
#
# Run from the repository root with $OUT set:  bash docs/results/split_gpu.sh call1
# then, on two cards:                          bash docs/results/split_gpu.sh call2
# SPECMEMO_DATA_DIR must hold models/SmolLM2-135M-Instruct.Q4_1.gguf and data/mt_bench_question.jsonl
# (the machine reaches no network): scripts/gpu_setup.sh sets it up from the carried folders.
set -x
source scripts/gpu_setup.sh
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}." PYTHONUNBUFFERED=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "${GPUS:-0}" -ge 2 ]; then DEVICES=cuda:0,cuda:1; TAG=2gpu; else DEVICES=cuda:0,cuda:0; TAG=1gpu; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu_split_$TAG.txt"
python3 -c "import torch, transformers, accelerate as a; print(torch.__version__, transformers.__version__, a.__version__)" \
  >> "$OUT/gpu_split_$TAG.txt"

case "$1" in
call1)
  timeout 90 python3 -m pytest -q -p no:cacheprovider tests/core/test_split.py -k gpus 2>&1 | tail -6 \
    | tee "$OUT/split_tests_$TAG.txt"
  # stdout: a summary (equality, tokens/s per batch size); the whole report in the JSON file
  timeout 420 python3 -m specmemo_core.tools.split_check --devices "$DEVICES" --batches 1,8 --queries 16 \
    --max-new-tokens 128 --repeats 3 --out "$OUT/split_check_$TAG.json" > "$OUT/split_check_$TAG.txt" \
    2> "$OUT/split_check_$TAG.err"
  echo "split_check rc=$? (1: a reply differs)"; tail -c 1500 "$OUT/split_check_$TAG.err"
  cat "$OUT/split_check_$TAG.txt"
  ;;
call2)
  [ "$TAG" = 2gpu ] || { echo "call2 needs two GPUs"; exit 2; }
  timeout 480 python3 -m specmemo_core.cli plan --model shape:vicuna-13b --device cuda --devices 0,1 --vram 16GiB \
    --precision bf16 --turns 20 --reply-tokens 32 --verify > "$OUT/plan_vicuna13b_bf16_2x16gib.txt" 2>&1
  echo "plan --verify rc=$?"; cat "$OUT/plan_vicuna13b_bf16_2x16gib.txt"
  ;;
*)
  echo "usage: bash docs/results/split_gpu.sh call1|call2"; exit 2 ;;
esac
