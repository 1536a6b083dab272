# Source on the GPU machine (the device tool), from the repository root:  source scripts/gpu_setup.sh
#
# What the GPU image lacks comes in git-ignored folders carried with the call (64 MiB a call):
#   .whl/       wheels (pip download --no-deps gguf torchao platformdirs accelerate psutil)
#               and data/mt_bench_question.jsonl (the machine reaches no index)
#   .whl_lite/  gguf, platformdirs and psutil's wheels and data/: what a GGUF part leaves room for
#   .gguf1/     the default GGUF gzipped (gzip -9: 92.7 MB), its first 46,400,000 bytes
#               (split -b 46400000), as part_aa.gz, carried by one call
#   .gguf2/     the rest, part_ab.gz, carried by the next call made at once (the machine keeps /tmp
#               ~30 s): each fits the 64 MiB with the tracked tree (~15 MB) and .whl_lite, so a
#               fresh machine needs just the two calls (unzipped halves of 49 MB did not fit)
# The first call copies its part to /tmp; the call with the second joins and unzips them and checks
# the sha256.
export SPECMEMO_DATA_DIR=/tmp/smdata PYTHONPATH=/tmp/site:.
mkdir -p /tmp/smdata/models /tmp/smdata/data /tmp/site
for wheel in .whl/*.whl .whl_lite/*.whl; do  # each wheel once a machine (a warm one keeps /tmp/site)
  name=${wheel##*/}
  [ -f "$wheel" ] && [ ! -d "/tmp/site/${name%%-*}" ] \
    && python3 -m pip install -q --no-index --no-deps --target /tmp/site "$wheel"
done
cp -n .whl/data/* .whl_lite/data/* /tmp/smdata/data/ 2>/dev/null
GGUF=/tmp/smdata/models/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f .gguf1/part_aa.gz ] && cp .gguf1/part_aa.gz /tmp/part_aa.gz
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# a file left by an earlier, cut call is checked too: only the right bytes stay
[ -s "$GGUF" ] && { echo "$SHA  $GGUF" | sha256sum -c --status - || rm -f "$GGUF"; }
if [ ! -s "$GGUF" ] && [ -f /tmp/part_aa.gz ] && [ -f .gguf2/part_ab.gz ]; then
  cat /tmp/part_aa.gz .gguf2/part_ab.gz | gunzip > "$GGUF"
  echo "$SHA  $GGUF" | sha256sum -c - || rm -f "$GGUF"
fi
