#!/usr/bin/env bash
# One call on the H200 machine: build, test on the GPU, time the step, run the engine.
#   run via the device tool:  bash benchmarks/gpu_engine.sh   (results under $OUT)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
MPI="mpirun --allow-run-as-root --oversubscribe"
export SWIFTSPEC_TEST_MPIEXEC="$MPI" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
SW="python3 -m swiftspec_mpi"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
python3 -c "import torch, cupy; print('torch', torch.__version__, 'cupy', cupy.__version__, torch.cuda.device_count())"

echo "== step benchmark"
python3 benchmarks/bench_gpu_step.py --context 1024 --json "$OUT/step.json" 2>&1 | tee "$OUT/step.md"

echo "== pytest -m gpu"
timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_kernels_gpu.py tests/test_fused_ops_gpu.py -rA 2>&1 | grep -v "^PASSED" | tail -40 | tee "$OUT/pytest_gpu.txt"

echo "== engine: dummy shapes, draft and verify ranks sharing the GPU"
P="Write a quicksort in Python with comments explaining each step."
for cfg in "ar 1" "sync 1" "async 2"; do
  set -- $cfg
  timeout 300 $MPI -n $2 $SW run --load-format dummy --target llama-3-8b --draft llama-3.2-1b \
    --mode $1 --device cuda --dtype bfloat16 --prompt "$P" --max-new-tokens 128 --ignore-eos \
    --out "$OUT/dummy8b-$1.h5" --overwrite --quiet 2>&1 | tail -5
  $SW analyze "$OUT/dummy8b-$1.h5" --json > "$OUT/dummy8b-$1.json" 2>/dev/null
  python3 -c "import json;d=json.load(open('$OUT/dummy8b-$1.json'));d=d[0] if isinstance(d,list) else d;r=d['requests'][0];print('$1', 'tok/s', round(r['tokens_per_s'],1), 'accepted/step', d.get('mean_accepted_length'))"
done
echo "== engine: dummy 1B target, self-speculation (4-layer draft), greedy async == ar, bf16 and float32"
for dt in bfloat16 float32; do
for cfg in "ar 1" "async 2"; do
  set -- $cfg
  timeout 300 $MPI -n $2 $SW run --load-format dummy --target llama-3.2-1b --draft-layers 4 \
    --mode $1 --device cuda --dtype $dt --prompt "$P" --max-new-tokens 96 --ignore-eos \
    --out "$OUT/dummy1b-$1-$dt.h5" --overwrite --quiet 2>&1 | tail -5
done
python3 benchmarks/compare_outputs.py "$OUT/dummy1b-ar-$dt.h5" "$OUT/dummy1b-async-$dt.h5" \
  --target llama-3.2-1b --dtype $dt
done
ls -la "$OUT"
