#!/usr/bin/env bash
# The engine runs of benchmarks/gpu_engine.sh (which calls this with NO_SETUP=1); alone, it
# installs, runs tests/test_gpu_engine.py, then the runs:   bash benchmarks/gpu_engine_runs.sh   (results under $OUT)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
if [[ -z "${NO_SETUP:-}" ]]; then   # gpu_engine.sh sets NO_SETUP=1: it installed and tested already
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py 2>&1 | tail -5
fi
P="Write a quicksort in Python with comments explaining each step."
for cfg in "ar 1" "sync 1" "async 2"; do
  set -- $cfg
  timeout 300 $MPI -n $2 $SW run --load-format dummy --target llama-3-8b --draft llama-3.2-1b \
    --mode $1 --device cuda --dtype bfloat16 --prompt "$P" --max-new-tokens 128 --ignore-eos \
    --out "$OUT/dummy8b-$1.h5" --overwrite --quiet > "$OUT/run-8b-$1.log" 2>&1 || tail -20 "$OUT/run-8b-$1.log"
  $SW analyze "$OUT/dummy8b-$1.h5" > "$OUT/dummy8b-$1.txt" 2>&1
  grep -E "tokens/s  |TTFT|prefill|mean accepted|verify: verify|draft: expand|idle|decode|graphs captured" "$OUT/dummy8b-$1.txt"
done
# async again with both ranks served by a CUDA MPS daemon (jobs/mps.sh; without it the two
# processes take turns on the one GPU)
source "$(dirname "${BASH_SOURCE[0]}")/../jobs/mps.sh"
MPS=1 mps_start 2 1
timeout 300 $MPI -n 2 $SW run --load-format dummy --target llama-3-8b --draft llama-3.2-1b \
  --mode async --device cuda --dtype bfloat16 --prompt "$P" --max-new-tokens 128 --ignore-eos \
  --out "$OUT/dummy8b-async-mps.h5" --overwrite --quiet > "$OUT/run-8b-async-mps.log" 2>&1 || tail -20 "$OUT/run-8b-async-mps.log"
mps_stop
$SW analyze "$OUT/dummy8b-async-mps.h5" > "$OUT/dummy8b-async-mps.txt" 2>&1
grep -E "tokens/s  |TTFT|prefill|mean accepted|verify: verify|draft: expand|idle|decode|graphs captured" "$OUT/dummy8b-async-mps.txt"
for dt in bfloat16 float32; do
for cfg in "ar 1" "async 2"; do
  set -- $cfg
  timeout 300 $MPI -n $2 $SW run --load-format dummy --target llama-3.2-1b --draft-layers 4 \
    --mode $1 --device cuda --dtype $dt --prompt "$P" --max-new-tokens 96 --ignore-eos \
    --out "$OUT/dummy1b-$1-$dt.h5" --overwrite --quiet > "$OUT/run-1b-$1-$dt.log" 2>&1 || tail -20 "$OUT/run-1b-$1-$dt.log"
done
python3 benchmarks/compare_outputs.py "$OUT/dummy1b-ar-$dt.h5" "$OUT/dummy1b-async-$dt.h5" \
  --target llama-3.2-1b --dtype $dt
done
