#!/usr/bin/env bash
# Train (or resume) heads for the default model on a CUDA machine. Usage:
#   scripts/gpu_train_heads.sh KIND OUT_DIR [PROMPTS] [STEPS] [LAYERS] [EXTRA train-heads ARGS...]
# e.g. scripts/gpu_train_heads.sh hydra /tmp/h 8000 4000 1 --context-layer --turns 2
# Expects the default GGUF at $SPECMEMO_DATA_DIR/models/ (fetched with pip elsewhere)
# and prompt files from scripts/make_prompt_files.py in .payload/. Re-running with the
# same OUT_DIR reuses its distilled replies (distill.safetensors, heldout.safetensors):
# copy them back from a previous run to skip the ~4 minutes of generation.
set -euo pipefail
KIND=${1:-hydra}; OUT=${2:-/tmp/heads-$KIND}; PROMPTS=${3:-8000}; STEPS=${4:-4000}; LAYERS=${5:-1}
shift $(( $# < 5 ? $# : 5 ))
python3 -m specmemo_core.cli train-heads --model default --out "$OUT" --kind "$KIND" --layers "$LAYERS" \
  --prompts "$PROMPTS" --steps "$STEPS" --prompts-file .payload/train.jsonl \
  --heldout-file .payload/heldout.jsonl --heldout-prompts 400 --gen-batch 512 --device cuda "$@"
