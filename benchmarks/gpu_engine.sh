#!/usr/bin/env bash
# One call on the H200 machine: build, test on the GPU, time the step, run the engine.
#   run via the device tool:  bash benchmarks/gpu_engine.sh   (results under $OUT)
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, torch.cuda.device_count())"

echo "== step benchmark"
python3 benchmarks/bench_gpu_step.py --context 1024 --json "$OUT/step.json" 2>&1 | tee "$OUT/step.md"

echo "== pytest -m gpu"
timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_kernels_gpu.py tests/test_fused_ops_gpu.py -rA 2>&1 | grep -v "^PASSED" | tail -40 | tee "$OUT/pytest_gpu.txt"

echo "== engine: dummy shapes (benchmarks/gpu_engine_runs.sh)"
NO_SETUP=1 bash benchmarks/gpu_engine_runs.sh
ls -la "$OUT"
