# sourced at the start of every device call: wheels, data folder
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 SPECMEMO_DATA_DIR=/tmp/smdata
mkdir -p /tmp/smdata/models /tmp/smdata/data
cp -n .gpu/data/* /tmp/smdata/data/ 2>/dev/null
cp -n .gpu/SmolLM2-135M-Instruct.Q4_1.gguf.verified /tmp/smdata/models/ 2>/dev/null
ln -sfn ../assets .old/assets
set -x
source scripts/gpu_setup.sh
cp .gguf1/part_aa /tmp/part_aa
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
# CUDA tests of the decoders (tiny models; skipped on CPU in CI)
PYTHONPATH=/tmp/site:. timeout 400 python3 -m pytest -q -p no:cacheprovider tests/core/test_static_decoding.py tests/core/test_lookup.py tests/core/test_decoding.py tests/core/test_model.py -k "cuda or graph or Graph or CUDA" 2>&1 | tail -25 | tee $OUT/cuda_tests.txt
source scripts/gpu_setup.sh
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
source scripts/gpu_setup.sh
test -s /tmp/smdata/models/SmolLM2-135M-Instruct.Q4_1.gguf || { echo "model gone (machine went cold)"; exit 3; }
D=docs/results/refactor_check/dump_replies.py
# fp32 identity on the CPU (the laptop path), old vs new, plain and the CPU planner's tree
for layout in old new; do
  if [ $layout = old ]; then P=/tmp/site:.old; else P=/tmp/site:.; fi
  PYTHONPATH=$P timeout 250 python3 $D --device cpu --dtype fp32 --trees none,calibrated-6+lookup-3 --out $OUT/cpu_fp32_$layout.json 2>&1 | tail -3
done
PYTHONPATH=/tmp/site:. python3 $D --compare $OUT/cpu_fp32_old.json $OUT/cpu_fp32_new.json | tee $OUT/compare_cpu.txt
