#!/usr/bin/env bash
# One call on the H200 machine: the whole decode step under several SWIFTSPEC_L2_PREFETCH
# settings (each GEMV asking the L2 for the start of the next GEMV's weight), interleaved in one
# process per shape (benchmarks/bench_step_breakdown.py --l2-prefetch).
#   run via the device tool:  bash benchmarks/gpu_l2_prefetch.sh   (results under $OUT)
# SPECS_8B / SPECS_1B override the ';'-separated settings (the first is the baseline).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
if [ -z "${NO_SETUP:-}" ]; then
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
fi
ALL() { echo "qkv=$1,o=$2,gu=$3,down=$4,head=$5"; }
SPECS_8B=${SPECS_8B:-"off;o=24;o=32;o=16;$(ALL 8 24 8 8 8);$(ALL 16 24 16 16 16);$(ALL 4 24 4 4 4);gu=8;down=8;qkv=8"}
SPECS_1B=${SPECS_1B:-"off;o=8;$(ALL 4 8 4 4 4);$(ALL 8 8 8 8 8);$(ALL 12 8 16 16 16);$(ALL 12 8 32 32 32)"}
for n in 1 8; do
  echo "== llama-3-8b N = $n"
  python3 benchmarks/bench_step_breakdown.py --shape llama-3-8b --n $n --l2-prefetch "$SPECS_8B" \
    --json "$OUT/l2pf-8b-n$n.json" 2>&1 | tee "$OUT/l2pf-8b-n$n.md"
done
echo "== llama-3.2-1b N = 8"
python3 benchmarks/bench_step_breakdown.py --shape llama-3.2-1b --n 8 --l2-prefetch "$SPECS_1B" \
  --json "$OUT/l2pf-1b-n8.json" 2>&1 | tee "$OUT/l2pf-1b-n8.md"
