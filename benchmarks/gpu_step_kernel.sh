#!/usr/bin/env bash
# The persistent step kernel on one GPU: its kernel tests, its benchmark beside the chain (and the
# gpt-fast int4 peer when PEER names shapes), then the engine test; logs into $OUT. From the
# checkout root, after `python3 setup.py build_ext --inplace`:
#   [ROWS=1b-bf16,...] [PEER=llama-3.2-1b,llama-3-8b,llama-3-70b] bash benchmarks/gpu_step_kernel.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD
ROWS=${ROWS:-1b-bf16,1b-int4,8b-bf16,8b-int4,70b-int4}
PEER=${PEER:-}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 150 python3 -m pytest -q -x -m gpu tests/test_step_kernel_gpu.py -k "not engine" -p no:cacheprovider -s \
  2>&1 | tee "$OUT/tests.log" | grep -E "passed|failed|Error|assert|^llama|^qwen" | tail -12
timeout 200 python3 benchmarks/bench_step_kernel.py --rows "$ROWS" ${PEER:+--peer "$PEER"} --json "$OUT/bench.json" \
  2>&1 | tee "$OUT/bench.log"
timeout 150 python3 -m pytest -q -m gpu tests/test_step_kernel_gpu.py -k engine -p no:cacheprovider 2>&1 \
  | tee "$OUT/engine.log" | tail -4
