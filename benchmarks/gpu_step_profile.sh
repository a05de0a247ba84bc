#!/usr/bin/env bash
# Where the persistent step kernel's time goes, on one GPU, within about 380 s: the in-place build,
# its timeline test and one logits case, the per-stage timeline beside the no-wait step
# (benchmarks/bench_step_timeline.py) for 1B bf16, 1B int4 and 8B int4 at N 1 and 8, then
# Nsight Compute's counters of one launch (1B int4 and 1B bf16, N = 1; clocks left alone).
# Logs into $OUT. From the checkout root:
#   bash benchmarks/gpu_step_profile.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
export PYTHONPATH=$PWD CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$PWD/.cache/cupy}
T0=$SECONDS
timeout 40 python3 setup.py build_ext --inplace -q -j 8 > "$OUT/build.log" 2>&1 || { echo "build failed"; tail -5 "$OUT/build.log"; }
STEP_KERNEL_CASES=quick timeout 80 python3 -m pytest -q -x -m gpu tests/test_step_kernel_gpu.py -p no:cacheprovider \
  -k "timeline or 1b-2-int4-128 or 16_warps" > "$OUT/tests.log" 2>&1
echo "tests rc $? at $((SECONDS - T0)) s"; tail -3 "$OUT/tests.log"
timeout 170 python3 benchmarks/bench_step_timeline.py --rows 1b-bf16,1b-int4,8b-int4 --n 1,8 --warps 8,16 \
  --json "$OUT/timeline.json" > "$OUT/timeline.md" 2>&1
echo "timeline rc $? at $((SECONDS - T0)) s"
if command -v ncu >/dev/null; then
  for row in 1b-int4 1b-bf16; do
    LEFT=$((370 - (SECONDS - T0))); ((LEFT < 20)) && break
    timeout $LEFT ncu --clock-control none --kernel-name regex:step_kernel --launch-skip 12 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
      --section Occupancy --section LaunchStats \
      python3 benchmarks/bench_step_timeline.py --rows $row --n 1 > "$OUT/ncu_$row.txt" 2>&1
    echo "ncu $row rc $? at $((SECONDS - T0)) s"
  done
fi
