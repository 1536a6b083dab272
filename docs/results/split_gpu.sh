#!/usr/bin/env bash
# Issue 24 (several GPUs: split the layers) on a machine with one or two CUDA GPUs, in one
# device call of about 8 minutes at most:
#
#   1. the CUDA cases of tests/core/test_split.py: a tiny model split in two on one card
#      (cuda:0,cuda:0) and, with two cards, over both (cuda:0,cuda:1), greedy == one card's;
#   2. tools/split_check on the default model with its shipped heads, bf16: split evenly over
#      cuda:0,cuda:1 (two cards) or cuda:0,cuda:0 (one card: two segments, captured as CUDA
#      graphs), 16 MT-Bench first turns as requests, 128 new tokens, batch 1 and batch 8,
#      plain and speculative (the planner's tree per batch size), 3 timed rounds on the split
#      model (median, min-max) and one round of the whole model on cuda:0 to compare every
#      reply token for token;
#   3. with two cards: specmemo plan for vicuna-13b in bf16 with each card capped at 16 GiB,
#      split over both (plan --verify of a split plan is not there yet).
#
# Run from the repository root with $OUT set:  bash docs/results/split_gpu.sh
# SPECMEMO_DATA_DIR must hold models/SmolLM2-135M-Instruct.Q4_1.gguf and data/mt_bench_question.jsonl
# (the machine reaches no network); .gpu/setup.sh, where present, sets it up as for the other runs.
set -x
[ -f .gpu/setup.sh ] && source .gpu/setup.sh
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}." PYTHONUNBUFFERED=1
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "${GPUS:-0}" -ge 2 ]; then DEVICES=cuda:0,cuda:1; TAG=2gpu; else DEVICES=cuda:0,cuda:0; TAG=1gpu; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu_split_$TAG.txt"
python3 -c "import torch, transformers, accelerate as a; print(torch.__version__, transformers.__version__, a.__version__)" \
  >> "$OUT/gpu_split_$TAG.txt"

timeout 90 python3 -m pytest -q -p no:cacheprovider tests/core/test_split.py -k gpus 2>&1 | tail -6 \
  | tee "$OUT/split_tests_$TAG.txt"

timeout 420 python3 -m specmemo_core.tools.split_check --devices "$DEVICES" --batches 1,8 --queries 16 \
  --max-new-tokens 128 --repeats 3 --json --out "$OUT/split_check_$TAG.json" > /dev/null 2> "$OUT/split_check_$TAG.err"
echo "split_check rc=$? (1: a reply differs)"; tail -c 1500 "$OUT/split_check_$TAG.err"
python3 - "$OUT/split_check_$TAG.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["model"], d["precision"], "split", d["layers"], "over", d["devices"], "graphs", d["graphs"], "trees", d["trees"])
print("greedy equal to one card:", d["all_equal"], d["equal"])
for b, e in d["split"].items():
    p, s = e["plain"]["tokens_per_s"], e["speculative"]["tokens_per_s"]
    print(f"batch {b}: plain {p['median']} ({p['min']}-{p['max']}) tok/s, speculative {s['median']} "
          f"({s['min']}-{s['max']}) tok/s on {e['speculative']['tree']}, speedup {e['speedup']}")
EOF

if [ "$TAG" = 2gpu ]; then
  timeout 120 python3 -m specmemo_core.cli plan --model shape:vicuna-13b --device cuda --devices 0,1 --vram 16GiB \
    --precision bf16 --turns 20 > "$OUT/plan_vicuna13b_bf16_2x16gib.txt" 2>&1
  echo "plan rc=$?"; cat "$OUT/plan_vicuna13b_bf16_2x16gib.txt"
fi
