#!/usr/bin/env bash
# The persistent step kernel's quick check on one GPU, within about 170 s: the in-place build, a
# representative subset of its kernel tests (Llama-3.2-1B bf16 and int4 g128, Qwen2.5-0.5B bf16
# with biases; N 1, 8, 32 at contexts near 1024 and 4096; the graph and the watchdog), then its
# benchmark beside the chain (one token and 8-node verify) for 1B bf16, 1B int4 and 8B int4.
# Logs into $OUT. From the checkout root:
#   bash benchmarks/gpu_step_kernel_quick.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/.cache/cupy}   # cubins kept across calls
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 40 python3 setup.py build_ext --inplace -q -j 8 > "$OUT/build.log" 2>&1 || { echo "build failed"; tail -5 "$OUT/build.log"; }
echo "build done at $((SECONDS - T0)) s"
STEP_KERNEL_CASES=quick timeout 70 python3 -m pytest -q -x -m gpu tests/test_step_kernel_gpu.py -p no:cacheprovider -s \
  -k "1b-2-none-128 or 1b-2-int4-128 or qwen2.5-0.5b-3-none-128 or graph or watchdog" \
  > "$OUT/tests.log" 2>&1
echo "tests rc $? at $((SECONDS - T0)) s"
grep -E "passed|failed|Error|assert|^llama|^qwen" "$OUT/tests.log" | tail -12
LEFT=$((168 - (SECONDS - T0))); ((LEFT < 10)) && LEFT=10
timeout $LEFT python3 benchmarks/bench_step_kernel.py --rows 1b-bf16,1b-int4,8b-int4 \
  --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
echo "bench rc ${PIPESTATUS[0]} at $((SECONDS - T0)) s"
