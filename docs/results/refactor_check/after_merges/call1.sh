set -x
source .gpu/setup.sh
cp .gguf1/part_aa /tmp/part_aa
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.is_available())"
# CUDA tests of the decoders (tiny models; skipped on CPU in CI)
PYTHONPATH=/tmp/site:. timeout 400 python3 -m pytest -q -p no:cacheprovider tests/core/test_static_decoding.py tests/core/test_lookup.py tests/core/test_decoding.py tests/core/test_model.py tests/core/test_offload.py tests/core/test_plan_check.py tests/core/test_timing.py -k "cuda or graph or Graph or CUDA or timing or forward" 2>&1 | tail -25 | tee $OUT/cuda_tests.txt
