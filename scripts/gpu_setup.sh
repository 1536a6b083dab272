# Source on the GPU machine (the device tool), from the repository root:  source scripts/gpu_setup.sh
#
# What the GPU image lacks comes in git-ignored folders carried with the call (64 MiB a call):
#   .whl/       wheels (pip download --no-deps gguf torchao platformdirs accelerate psutil)
#               and data/mt_bench_question.jsonl (the machine reaches no index)
#   .gguf1/     the default GGUF's first 51,000,000 bytes (split -b 51000000), carried by one call
#   .gguf2/     the rest, carried by the next call made at once (the machine keeps /tmp ~30 s) with
#               .whl beside it: both fit the 64 MiB with the tracked tree (~15 MB), so a fresh
#               machine needs just the two calls
# The first call copies its part to /tmp; the call with the second joins them and checks the sha256.
export SPECMEMO_DATA_DIR=/tmp/smdata PYTHONPATH=/tmp/site:.
mkdir -p /tmp/smdata/models /tmp/smdata/data /tmp/site
python3 -c "import gguf, torchao, platformdirs, accelerate, psutil" 2>/dev/null \
  || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
cp -n .whl/data/* /tmp/smdata/data/ 2>/dev/null
GGUF=/tmp/smdata/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f .gguf1/part_aa ] && cp .gguf1/part_aa /tmp/part_aa
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# a file left by an earlier, cut call is checked too: only the right bytes stay
[ -s "$GGUF" ] && { echo "$SHA  $GGUF" | sha256sum -c --status - || rm -f "$GGUF"; }
if [ ! -s "$GGUF" ] && [ -f /tmp/part_aa ] && [ -f .gguf2/part_ab ]; then
  cat /tmp/part_aa .gguf2/part_ab > "$GGUF"
  echo "$SHA  $GGUF" | sha256sum -c - || rm -f "$GGUF"
fi
