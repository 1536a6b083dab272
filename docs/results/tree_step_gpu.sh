# Issues 23 and 22: where a tree step's time goes on the GPU machine (device tool), from the
# repository root, carrying .whl:
#   bash docs/results/tree_step_gpu.sh [profile|blas|attention] [shapes]
#   profile: plain and medusa-64 steps as graphs (compiled regions), then one eager step of each under the profiler,
#            by phase (draft, verify, accept, commit) and by kernel; heads drafting over the whole
#            vocabulary (v0) and over 8,192 tokens as trained heads do (v8192)
#   blas:    whole steps with the compiled regions' matmuls through cuBLAS, cuBLASLt (+lt), and
#            inductor's autotuned tiles (autotune), 2 rounds alternating
#   attention: the attention alone (32 layers; T = 1 and 64), one pass over the span against the chunks merged:
#            a trial at commit 2508796, reverted after (slower); run it at that commit
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-profile}
case "$what" in
profile)
  for shape in ${2:-vicuna-7b smollm2-135m}; do for v in 0 8192; do
    timeout ${3:-150} python3 scripts/time_graph_steps.py --shape $shape --dtype bf16 --trees single,medusa-64 \
      --modes graphs --steps 50 --kernels --compile --draft-vocab $v > "$OUT/profile-$shape-v$v.jsonl" 2> "$OUT/profile-$shape-v$v.err"
    tail -1 "$OUT/profile-$shape-v$v.err" | cut -c 1-300
  done; done
  python3 scripts/show_step_profile.py "$OUT"/profile-*.jsonl
  ;;
blas)
  for shape in ${2:-vicuna-7b}; do
    timeout ${3:-400} python3 scripts/time_graph_steps.py --shape $shape --dtype bf16 --trees single,medusa-64 \
      --steps 100 --regions compiled,compiled+lt,autotune --repeats 2 --draft-vocab 8192 \
      > "$OUT/blas-$shape.jsonl" 2> "$OUT/blas-$shape.err"
    grep -v '"shape"' "$OUT/blas-$shape.jsonl"; tail -2 "$OUT/blas-$shape.err" | cut -c 1-300
  done ;;
attention)  # the attention alone, one pass over the span against chunks merged (SPLIT:WARPS:STAGES:ROWS)
  V=${V:-0:4:2:16,0:4:3:16,0:8:2:16,0:4:2:32,0:4:2:64,0:8:3:32,128:4:2:16,128:4:2:32,256:4:2:16,512:4:2:16,512:4:3:16}
  for shape in ${2:-vicuna-7b smollm2-135m}; do for span in 1024 2048; do
    timeout ${3:-100} python3 scripts/time_step_parts.py --shape $shape --parts attention --no-others --span $span \
      --variants $V > "$OUT/attention-$shape-span$span.jsonl" 2> "$OUT/attention-$shape-span$span.err"
    grep -v '"shape"' "$OUT/attention-$shape-span$span.jsonl"; tail -1 "$OUT/attention-$shape-span$span.err" | cut -c 1-300
  done; done ;;
esac
