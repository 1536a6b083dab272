#!/usr/bin/env bash
# Issue 22 item 2 on one H200: hydra heads whose context layer reads each position's next token
# (train-heads --context-next), trained on the 4,000 replies the feature-layers trial distilled
# (docs/results/feature_layers_gpu.sh; carried in .out/trial/, so no reply is generated again).
# Device calls made back to back:
#   replies  (carry .out)           the distilled replies to /tmp/trial
#   copy     (carry .gguf1)         the GGUF's first part to /tmp
#   train    (carry .gguf2 .whl)    joins the GGUF; trains 4,000 steps and calibrates; the heads come back in $OUT
# The heads file itself stays out of the repository (every device call carries the tree, and a second
# 9.8 MB heads file beside the shipped one would leave no room for the GGUF's first part).
# Run from the repository root with $OUT set:  bash docs/results/heads_next_gpu.sh replies|copy|train
case "$1" in
replies) mkdir -p /tmp/trial && cp .out/trial/*.safetensors /tmp/trial/ && ls -la /tmp/trial ;;
copy) source scripts/gpu_setup.sh; ls -la /tmp/part_aa ;;
train)
  source scripts/gpu_setup.sh
  export PYTHONUNBUFFERED=1
  timeout 500 python3 -m specmemo_core.cli train-heads --model default --out /tmp/trial --kind hydra --layers 1 \
    --context-next --prompts 4000 --steps 4000 --prompts-file assets/prompts/heads_training.jsonl.gz \
    --heldout-file assets/prompts/heads_heldout.jsonl.gz --heldout-prompts 400 --reply-tokens 256 --gen-batch 512 \
    --device cuda > "$OUT/card_stdout.json" 2> "$OUT/train.err"
  echo "rc=$?"; grep -v -i warn "$OUT/train.err" | grep -v "^\s*$" | tail -n 12
  cp /tmp/trial/heads.safetensors /tmp/trial/calibration.json /tmp/trial/card.json "$OUT/" 2>/dev/null
  cat "$OUT/card_stdout.json" | head -c 1500 ;;
esac
