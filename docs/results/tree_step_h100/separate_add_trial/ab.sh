source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p $OUT
for r in 1 2; do for v in after before; do
  cp .ab/model_$v.py specmemo_core/runtime/model.py
  for s in smollm2-135m vicuna-7b; do
    ms=$(timeout 110 python3 scripts/time_graph_steps.py --shape $s --trees medusa-64 --modes graphs --steps 100 --compile --draft-vocab 8192 2>>$OUT/ab.err | tail -1)
    echo "{\"round\": $r, \"code\": \"$v\", \"result\": $ms}" | tee -a $OUT/ab.jsonl | cut -c 1-200
  done
done; done
