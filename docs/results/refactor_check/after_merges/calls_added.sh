# What the calls after the merges ran besides ../device_calls.sh (same setup, call1, call2):
# call1: the CUDA tests now also select offload, plan-check and timing tests
#   pytest tests/core/test_static_decoding.py tests/core/test_lookup.py tests/core/test_decoding.py \
#     tests/core/test_model.py tests/core/test_offload.py tests/core/test_plan_check.py tests/core/test_timing.py \
#     -k "cuda or graph or Graph or CUDA or timing or forward"
# call2, appended: host->device bandwidth and streamed-layer forwards (default model, bf16)
PYTHONPATH=/tmp/site:. timeout 30 python3 -c "from specmemo_core.runtime.host_link import host_to_device_bandwidth as b; print('h2d GB/s', b('cuda')/1e9)"
for r in 15 0; do
  PYTHONPATH=/tmp/site:. timeout 60 python3 -m specmemo_core.tools.offload_probe --model default --dtype bf16 --resident $r --sizes 1,16,64,128 --repeats 5
done
