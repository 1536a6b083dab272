#!/usr/bin/env bash
# Train (or resume) the shipped heads for the default model on a CUDA machine, then
# evaluate acceptance on the 20 MT-Bench queries. Usage:
#   scripts/gpu_train_heads.sh KIND OUT_DIR [PROMPTS] [STEPS] [LAYERS]
# Expects the default GGUF at $SPECMEMO_DATA_DIR/models/ (fetched with pip elsewhere)
# and prompt files from scripts/make_prompt_files.py in .payload/.
set -euo pipefail
KIND=${1:-hydra}; OUT=${2:-/tmp/heads-$KIND}; PROMPTS=${3:-8000}; STEPS=${4:-4000}; LAYERS=${5:-1}
python3 -m specmemo_core.cli train-heads --model default --out "$OUT" --kind "$KIND" --layers "$LAYERS" \
  --prompts "$PROMPTS" --steps "$STEPS" --prompts-file .payload/train.jsonl \
  --heldout-file .payload/heldout.jsonl --heldout-prompts 400 --gen-batch 512 --device cuda
