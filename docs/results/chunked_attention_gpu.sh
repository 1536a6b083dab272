# Issue 23, the chunked attention (runtime/chunked_attention.py) on the GPU machine (device tool),
# from the repository root, carrying .whl (and, for bench, the GGUF as step_overhead_gpu.sh's copy/check carry it):
#   bash docs/results/chunked_attention_gpu.sh [parts|tune|steps|gemv|exact|bench]
#   parts: attention alone (ours against cuDNN's SDPA, 32 layers, T = 1 and a 64-node tree), spans 1,024 and 2,048
#   tune:  the same at other chunk sizes and launches (SPLIT:WARPS:STAGES; tuning/)
#   steps: whole steps (time_graph_steps.py), compiled regions with ours and with SDPA, alternating, 3 rounds
#   gemv:  one-token matmuls, cuBLAS against a Triton GEMV (scripts/time_gemv.py)
#   exact: the GPU decoders' tests (greedy speculative = plain greedy, fp32) and the kernel's against SDPA
#   bench: specmemo bench on the 20 MT-Bench queries, bf16 and fp32 (bench/)
# Results of 2026-12-04: docs/results/chunked_attention_h200/ (README, "Chunked attention").
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-parts}
V=128:2:3,128:8:3,128:4:1,128:4:2,128:4:4,128:8:2,256:4:3,256:8:3,256:8:2,256:4:2,64:4:3,64:2:3
case "$what" in
parts|tune)
  for shape in vicuna-7b llama-3-8b; do for span in 1024 2048; do
    extra=""; [ "$what" = tune ] && extra="--variants $V"
    timeout 100 python3 scripts/time_step_parts.py --shape $shape --parts attention --no-others --span $span $extra \
      > "$OUT/$shape-attention-span$span.jsonl" 2> "$OUT/$shape-attention-span$span.err"
    grep -v '"shape"' "$OUT/$shape-attention-span$span.jsonl"
  done; done ;;
steps)
  for shape in ${2:-vicuna-7b llama-3-8b smollm2-135m}; do
    timeout ${3:-200} python3 scripts/time_graph_steps.py --shape $shape --dtype bf16 --trees single,medusa-64 \
      --steps 100 --regions compiled,compiled-sdpa --repeats 3 > "$OUT/$shape-steps.jsonl" 2> "$OUT/$shape-steps.err"
    tail -1 "$OUT/$shape-steps.jsonl"
  done ;;
gemv)
  for shape in vicuna-7b llama-3-8b; do
    timeout 200 python3 scripts/time_gemv.py --shape $shape > "$OUT/gemv-$shape.jsonl" 2> "$OUT/gemv-$shape.err"
    grep -v error "$OUT/gemv-$shape.jsonl"
  done ;;
exact)
  timeout ${2:-150} python3 -m pytest -q -p no:cacheprovider tests/core/test_static_decoding.py \
    tests/core/test_chunked_attention.py tests/core/test_growth.py tests/core/test_batch_decoding.py > "$OUT/exact.log" 2>&1
  tail -3 "$OUT/exact.log" ;;
bench)
  for d in bf16 fp32; do
    timeout 170 python3 -m specmemo_core.cli bench --device cuda --dtype $d --methods vanilla+graphs,medusa-64+graphs,plan \
      --queries 20 --max-new-tokens 128 --repeats 3 --warmup 1 --json --save "$OUT/bench_mtbench20_$d.json" \
      > /dev/null 2> "$OUT/bench_mtbench20_$d.err"
    echo "$d rc=$?"
  done ;;
esac
