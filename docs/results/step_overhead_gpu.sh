#!/usr/bin/env bash
# Issues 22/23 on one H200: what a speculative step of the default model costs beyond a plain one,
# and the benches after bucketed prefill graphs (static_decoding.StaticDecoder._prefill_chunks) and the
# two-stage drafting top-k (heads.chunked_topk). Device calls made back to back (the machine keeps /tmp
# between them):
#   copy            (carry .gguf1)       the GGUF's first part to /tmp
#   check           (carry .gguf2 .whl)  joins the GGUF; the CUDA tests of the static and batched decoders
#                                        (graph captures, bucketed and staged prefills against eager ones)
#   bench D [W]     (carry .whl)         `specmemo bench` on the 20 MT-Bench queries, the 30 mixed prompts
#                                        and the 20 code prompts, 1 warm-up + 3 timed rounds each
# Run from the repository root with $OUT set:  bash docs/results/step_overhead_gpu.sh copy|check|bench bf16
source scripts/gpu_setup.sh
export PYTHONUNBUFFERED=1
case "$1" in
copy) ls -la /tmp/part_aa ;;
check)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/core/test_static_decoding.py tests/core/test_batch_decoding.py \
    > "$OUT/cuda_tests.txt" 2>&1
  echo "tests rc=$?"; tail -n 4 "$OUT/cuda_tests.txt" ;;
bench) bash docs/results/heads_ship_gpu.sh bench "$2" "${3:-mtbench20,mixed,code}" ;;  # the same benches as there
*) echo "usage: bash docs/results/step_overhead_gpu.sh copy|check|bench bf16|fp32 [mtbench20,mixed,code]"; exit 2 ;;
esac
