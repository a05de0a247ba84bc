#!/usr/bin/env bash
# One call on the H200 machine: build, test on the GPU, time the step, run the engine.
#   run via the device tool:  bash benchmarks/gpu_engine.sh   (results under $OUT)
# PARTS picks what runs after the build (default all): "step breakdown tests engine", e.g.
#   PARTS=tests bash benchmarks/gpu_engine.sh      then      PARTS="step breakdown engine" ...
# to split the work over two calls of the 600 s limit. STEP_ARGS adds options to the step
# benchmark (e.g. STEP_ARGS=--no-hf skips the HF transformers reference).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
PARTS=${PARTS:-"step breakdown tests engine"}
part() { [[ " $PARTS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, torch.cuda.device_count())"

if part step; then
  echo "== step benchmark"
  python3 benchmarks/bench_gpu_step.py --context 1024 ${STEP_ARGS:-} --json "$OUT/step.json" 2>&1 | tee "$OUT/step.md"
  echo "== host share of a step (benchmarks/bench_host_overhead.py)"
  python3 benchmarks/bench_host_overhead.py --shape llama-3-8b --n 1 2>&1 | tee "$OUT/host.md"
  python3 benchmarks/bench_host_overhead.py --shape llama-3.2-1b --n 8 2>&1 | tail -1 | tee -a "$OUT/host.md"
fi

if part breakdown; then
  echo "== step breakdown by kernel kind (benchmarks/bench_step_breakdown.py)"
  python3 benchmarks/bench_step_breakdown.py --shape llama-3-8b --n 1 --json "$OUT/breakdown-8b.json" 2>&1 | tee "$OUT/breakdown-8b.md"
  python3 benchmarks/bench_step_breakdown.py --shape llama-3.2-1b --n 8 --json "$OUT/breakdown-1b.json" 2>&1 | tee "$OUT/breakdown-1b.md"
fi

if part tests; then
  echo "== pytest -m gpu"
  timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_kernels_gpu.py tests/test_fused_ops_gpu.py -rA 2>&1 | grep -v "^PASSED" | tail -40 | tee "$OUT/pytest_gpu.txt"
fi

if part engine; then
  echo "== engine: dummy shapes (benchmarks/gpu_engine_runs.sh)"
  NO_SETUP=1 bash benchmarks/gpu_engine_runs.sh
fi
ls -la "$OUT"
