#!/usr/bin/env bash
# The persistent step kernel on one GPU: its tests, then its benchmark beside the chain and the
# gpt-fast int4 peer (benchmarks/bench_step_kernel.py), logs into $OUT. Run from the checkout root:
#   bash benchmarks/gpu_step_kernel.sh [rows] [peer shapes]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD
ROWS=${1:-1b-bf16,1b-int4,8b-bf16,8b-int4,70b-int4}
PEER=${2:-llama-3.2-1b,llama-3-8b,llama-3-70b}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
git log -1 --format=%H 2>/dev/null | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -m gpu tests/test_step_kernel_gpu.py -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -5
timeout 420 python3 benchmarks/bench_step_kernel.py --rows "$ROWS" --peer "$PEER" --json "$OUT/bench.json" 2>&1 \
  | tee "$OUT/bench.log"
