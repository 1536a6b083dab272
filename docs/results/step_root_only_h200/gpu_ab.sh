# usage: bash .out/gpu_ab.sh tests|SHAPE ROUNDS
source scripts/gpu_setup.sh >/dev/null 2>&1
mkdir -p "$OUT"
if [ "$1" = tests ]; then
  timeout 150 python3 -m pytest -q -x tests/core/test_static_decoding.py tests/core/test_batch_decoding.py tests/core/test_growth.py -k cuda -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; tail -3 "$OUT/gpu_tests.log"
  exit 0
fi
rm -rf /tmp/old && mkdir /tmp/old && cp -r specmemo_core scripts /tmp/old/ && cp .out/old/step.py /tmp/old/specmemo_core/runtime/step.py
shape=$1
for r in $(seq 1 $2); do
  for code in new old; do
    dir=.; [ $code = old ] && dir=/tmp/old
    (cd $dir && PYTHONPATH=/tmp/site:. timeout $3 python3 scripts/time_graph_steps.py --shape $shape --dtype bf16 --trees single,medusa-64 --steps 100 --regions compiled --repeats 2 --kernels) > "$OUT/$shape-$code-$r.jsonl" 2> "$OUT/$shape-$code-$r.err"
    echo "$shape $code $r"; tail -1 "$OUT/$shape-$code-$r.jsonl" | cut -c 1-600; grep -v -i warn "$OUT/$shape-$code-$r.err" | tail -2 | cut -c 1-200
  done
done
