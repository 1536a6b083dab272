source scripts/gpu_setup.sh
ln -sfn ../assets .bis1/assets; ln -sfn ../assets .bis2/assets
cat /tmp/part_aa .gguf2/part_ab > /tmp/smdata/models/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/smdata/models/SmolLM2-135M-Instruct.Q4_1.gguf
D=docs/results/refactor_check/dump_replies.py
for round in 1 2; do
for layout in old bis1 bis2 new; do
  case $layout in old) P=/tmp/site:.old;; bis1) P=/tmp/site:.bis1;; bis2) P=/tmp/site:.bis2;; new) P=/tmp/site:.;; esac
  echo "== $layout round $round"
  PYTHONPATH=$P timeout 100 python3 $D --device cuda --dtype bf16 --graphs --trees none --repeats 3 --out $OUT/bis_${layout}_$round.json 2>&1 | grep -v clean_up | tail -1
done
done
