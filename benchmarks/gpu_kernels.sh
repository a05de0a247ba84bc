#!/usr/bin/env bash
# Build, check and time the fused kernels on a GPU machine, in one go:
#
#   bash benchmarks/gpu_kernels.sh            # results in $OUT (default out/gpu_kernels/)
#
# 1. machine.txt   GPU, driver, nvcc, torch / CuPy / NCCL versions
# 2. compile.log   tools/compile_cuda.sh with ptxas' register / spill report
# 3. tests.log     pytest -m gpu tests/test_kernels_gpu.py (float64 references, NaN poisoning)
# 4. bench.log     benchmarks/bench_kernels_gpu.py; tables in bench_kernels.md / .json
# 5. sanitizer.log compute-sanitizer memcheck over one small call of each kernel (if present)
# 6. ncu.txt       Nsight Compute sections of one tree-attention and one GEMM launch (NO_NCU=1 skips)
# Options (environment): BASELINE=dir also times the previous GEMM kernel, dir/gemm_allreduce.cu
# (bench --baseline; e.g. `mkdir -p out/baseline && git show 2e8b252:cuda/gemm_allreduce.cu >
# out/baseline/gemm_allreduce.cu`), NO_NCU=1 skips ncu.
# Needs: python3 with torch (CUDA), cupy-cuda12x/13x, nvidia-nccl-cu12/13 >= 2.28, nvcc.
# Exit status: non-zero if the build, a test or a correctness check failed.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-$ROOT/out/gpu_kernels}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1   # never NVLink multicast
status=0

{
  date -u; nvidia-smi; nvcc --version | tail -2
  "$PY" - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      "x", torch.cuda.device_count())
try:
    from swiftspec_mpi.gpu.kernels import import_cupy
    print("cupy", import_cupy().__version__)
except Exception as e:
    print("cupy missing:", e)
from swiftspec_mpi.gpu import nccl_shim
print("nccl include", nccl_shim.nccl_include_dir(), "lib", nccl_shim.nccl_library_path())
try:
    print("nccl version", nccl_shim.get_nccl().version())
except Exception as e:
    print("nccl:", e)
EOF
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

echo "== compile (t=${SECONDS}s)"
# Fill CuPy's kernel cache in parallel with the compile check (each module is one nvcc run).
(
  for v in "tree_attention:" "gemm_allreduce:" "gemm_allreduce:nccl"; do
    "$PY" -c "import sys; from swiftspec_mpi.gpu import launch as k; n, v = sys.argv[1].split(':', 1); k.module(n, v, 0)" "$v" &
  done
  if [[ -z "${NO_NCU:-}" ]]; then
    SWIFTSPEC_KERNELS_LINEINFO=1 "$PY" -c "from swiftspec_mpi.gpu import launch as k; k.module('tree_attention', '', 0)" &
  fi
  if [[ -n "${BASELINE:-}" ]]; then
    "$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import bench_kernels_gpu as b; b.Baseline(Path(sys.argv[1]))" "$BASELINE" &
  fi
  wait
) >"$OUT/warmup.log" 2>&1 &
WARM=$!
CUBINS=$(mktemp -d)
VERBOSE=1 CUBIN_DIR="$CUBINS" PYTHON="$PY" timeout 200 bash tools/compile_cuda.sh >"$OUT/compile.log" 2>&1 || status=1
if command -v cuobjdump >/dev/null; then   # are the tensor-core / 16-byte / async-copy paths there?
  for c in "$CUBINS"/*.cubin; do
    sass=$(cuobjdump -sass "$c")
    echo "SASS $(basename "$c"): HMMA $(grep -c HMMA <<<"$sass"), LDSM $(grep -c LDSM <<<"$sass"), LDGSTS $(grep -c LDGSTS <<<"$sass"), LDG.128 $(grep -cE 'LDG.*\.128' <<<"$sass"), LDL/STL $(grep -cE '\b(LDL|STL)' <<<"$sass")"
  done >>"$OUT/compile.log"
fi
cat "$OUT/compile.log"
wait $WARM; tail -n 5 "$OUT/warmup.log"; rm -f "$OUT/warmup.log"

echo "== tests (t=${SECONDS}s)"
timeout 260 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py -rs 2>&1 \
  | tee "$OUT/tests.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

echo "== bench (t=${SECONDS}s)"
BENCH_ARGS=(--out "$OUT")
[[ -n "${BASELINE:-}" ]] && BENCH_ARGS+=(--baseline "$BASELINE")
timeout 260 "$PY" benchmarks/bench_kernels_gpu.py "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/bench.log"
[[ ${PIPESTATUS[0]} -eq 0 ]] || status=1

if command -v compute-sanitizer >/dev/null; then
  echo "== compute-sanitizer memcheck (t=${SECONDS}s)"
  timeout 120 compute-sanitizer --tool memcheck --print-limit 20 "$PY" benchmarks/bench_kernels_gpu.py --sanitize \
    >"$OUT/sanitizer.log" 2>&1
  tail -n 8 "$OUT/sanitizer.log"
fi

if command -v ncu >/dev/null && [[ -z "${NO_NCU:-}" ]]; then
  echo "== ncu (t=${SECONDS}s)"   # hardware counters of one launch per config (clocks left alone)
  NCU=(ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy
       --section LaunchStats --section MemoryWorkloadAnalysis)
  {
    SWIFTSPEC_KERNELS_LINEINFO=1 timeout 150 "${NCU[@]}" --section SourceCounters --section SchedulerStats \
      -k regex:tree_attention --launch-skip 2 --launch-count 2 \
      "$PY" benchmarks/bench_kernels_gpu.py --profile attention
    timeout 90 "${NCU[@]}" -k regex:gemm_rowparallel --launch-skip 1 --launch-count 1 \
      "$PY" benchmarks/bench_kernels_gpu.py --profile gemm
  } >"$OUT/ncu.txt" 2>&1
  grep -E "tree_attention|gemm_rowparallel|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Warp Cycles Per Issued|Stall|One or More Eligible" "$OUT/ncu.txt" | head -60
fi

echo "== status $status (t=${SECONDS}s)"
exit $status
