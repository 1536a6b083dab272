source .gpu/setup.sh
cat /tmp/part_aa .gguf2/part_ab > /tmp/smdata/models/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/smdata/models/SmolLM2-135M-Instruct.Q4_1.gguf
D=docs/results/refactor_check/dump_replies.py
run() { timeout 200 python3 $D "$@"; }
# fp32 identity + speed, old vs new, graphs (the app's GPU path)
for layout in old new; do
  if [ $layout = old ]; then P=/tmp/site:.old; else P=/tmp/site:.; fi
  PYTHONPATH=$P run --device cuda --dtype fp32 --graphs --trees none,calibrated-56+lookup-8,1-10-16-17+lookup-8 --repeats 2 --out $OUT/gpu_fp32_$layout.json 2>&1 | tail -4
done
for layout in new old; do
  if [ $layout = old ]; then P=/tmp/site:.old; else P=/tmp/site:.; fi
  PYTHONPATH=$P run --device cuda --dtype bf16 --graphs --trees none,calibrated-56+lookup-8 --repeats 3 --out $OUT/gpu_bf16_$layout.json 2>&1 | tail -3
done
PYTHONPATH=/tmp/site:. python3 $D --compare $OUT/gpu_fp32_old.json $OUT/gpu_fp32_new.json | tee $OUT/compare.txt
PYTHONPATH=/tmp/site:. python3 $D --compare $OUT/gpu_bf16_old.json $OUT/gpu_bf16_new.json | tee -a $OUT/compare.txt
# issue 19: host->device bandwidth and streamed-layer forwards (default model, bf16)
PYTHONPATH=/tmp/site:. timeout 30 python3 -c "from specmemo_core.runtime.host_link import host_to_device_bandwidth as b; print('h2d GB/s', b('cuda')/1e9)" 2>&1 | tee $OUT/bandwidth.txt
for r in 30 15 0; do PYTHONPATH=/tmp/site:. timeout 60 python3 -m specmemo_core.tools.offload_probe --model default --dtype bf16 --resident $r --sizes 1,16,64,128 --repeats 5 2>&1 | tail -12 | tee $OUT/offload_probe_r$r.txt; done
