#!/usr/bin/env bash
# The persistent step kernel on a real checkpoint, SmolLM2-135M-Instruct (Q4_1 GGUF; `swiftspec
# run` dequantizes it to bf16 on the GPU), within about 150 s on one H200: the in-place build,
# tests/test_step_kernel_real_gpu.py (persistent ar against the chain's, sync and async by the
# near-tie rule; strict: a missing file fails) and the kernel's logits at SmolLM2's shape with
# random weights (tests/test_step_kernel_gpu.py, quick cases), then greedy ar timed for both step
# kernels (2 prompts x 256 tokens; tokens/s of `swiftspec analyze`). Expects the GGUF at
# $SWIFTSPEC_SMOLLM2_GGUF (default /tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf). Logs and
# traces into $OUT (7 files). From the checkout root:
#   bash benchmarks/gpu_step_kernel_real.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/.cache/cupy}   # cubins kept across calls
export SWIFTSPEC_SMOLLM2_GGUF=${SWIFTSPEC_SMOLLM2_GGUF:-/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
GGUF=$SWIFTSPEC_SMOLLM2_GGUF
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
SUM=$(sha256sum "$GGUF" | cut -d" " -f1)
[[ $SUM == b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 ]] ||
  echo "WARNING: $GGUF (sha256 $SUM) is not SmolLM2-135M-Instruct.Q4_1.gguf (b179c952...)"
timeout 40 python3 setup.py build_ext --inplace -q -j 8 > "$OUT/build.log" 2>&1 || { echo "build failed"; tail -5 "$OUT/build.log"; }
echo "build done at $((SECONDS - T0)) s"
LEFT=$((115 - (SECONDS - T0)))         # the tests end by 115 s: 30 s stay for the timed runs
SWIFTSPEC_TEST_STRICT=1 STEP_KERNEL_CASES=quick timeout $LEFT python3 -m pytest -q -k smollm2 -p no:cacheprovider -s \
  tests/test_step_kernel_gpu.py tests/test_step_kernel_real_gpu.py > "$OUT/tests.log" 2>&1
echo "tests rc $? at $((SECONDS - T0)) s"
grep -E "passed|failed|skipped|Error|assert|took|gap|parts from|^smollm2" "$OUT/tests.log" | tail -24
printf '%s\n' '{"prompt": "Write a quicksort in Python with comments explaining each step."}' \
  '{"prompt": "Explain how a transformer language model generates text, step by step."}' > /tmp/prompts_smol.jsonl
for k in chain persistent; do
  LEFT=$((146 - (SECONDS - T0))); [[ $k == chain ]] && LEFT=$((LEFT / 2)); ((LEFT < 14)) && LEFT=14
  timeout $LEFT $MPI -n 1 $SW run --target "$GGUF" --mode ar --device cuda --dtype bfloat16 --step-kernel $k \
    --prompts /tmp/prompts_smol.jsonl --max-new-tokens 256 --ignore-eos --out "$OUT/ar-$k.h5" --overwrite --quiet \
    > "$OUT/run-$k.log" 2>&1 || tail -8 "$OUT/run-$k.log"
  echo "ar, --step-kernel $k: done at $((SECONDS - T0)) s"
done
$SW analyze "$OUT/ar-chain.h5" "$OUT/ar-persistent.h5" > "$OUT/ar.txt" 2>&1   # columns: chain, persistent
grep -E "^ +ar-|tokens/s  |GPU warm-up" "$OUT/ar.txt"
echo "all done at $((SECONDS - T0)) s"
