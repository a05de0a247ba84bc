#!/usr/bin/env bash
# One call on the H200 machine for the 4-bit GPU path: build, the W4A16 tests, the GEMV and step
# benchmarks (torch's int4 kernel and the gpt-fast-style int4 step re-run beside ours), engine runs with
# the 4-bit Llama-3-70B target.
#   run via the device tool:  bash benchmarks/gpu_w4a16.sh     (summaries under $OUT)
# PARTS picks what runs (default "tests gemv step engine"); "gputests" runs `pytest -m gpu` on
# every GPU test file. TARGET (default llama-3-70b) and DRAFTS (default "llama-3.2-3b
# llama-3.2-1b") pick the engine runs' shapes; POLICIES (default "rate") the --async-policy of
# the `async` runs, one run each; RUN_ARGS (e.g. "--head-bits 4") goes to every engine run. STEP_ARGS
# replaces the step benchmark's arguments. Full traces go to $RUNS (default /tmp/w4runs).
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
PARTS=${PARTS:-"tests gemv step engine"}
RUNS=${RUNS:-/tmp/w4runs}; mkdir -p "$RUNS"
part() { [[ " $PARTS " == *" $1 "* ]]; }
T0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m pip install --no-build-isolation --no-deps -e . > "$RUNS/install.log" 2>&1 || { tail -30 "$RUNS/install.log"; exit 1; }
echo "installed at $((SECONDS - T0)) s"

if part tests; then
  echo "== pytest tests/test_w4a16_gpu.py"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_w4a16_gpu.py -x 2>&1 | tail -15 | tee "$OUT/tests.txt"
  echo "tests done at $((SECONDS - T0)) s"
fi
if part gputests; then
  echo "== pytest -m gpu (every GPU test file)"
  timeout ${GPUTESTS_TIMEOUT:-420} python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors tests/ -rfEs 2>&1 | tail -25 | tee "$OUT/gputests.txt"
  echo "gpu tests done at $((SECONDS - T0)) s"
fi
if part gemv; then
  echo "== GEMV: ours vs torch int4"
  timeout 240 python3 benchmarks/bench_w4a16.py gemv --json "$OUT/gemv.json" 2>&1 | tee "$OUT/gemv.md"
  echo "gemv done at $((SECONDS - T0)) s"
fi
if part step; then
  echo "== 4-bit step"
  timeout ${STEP_TIMEOUT:-480} python3 benchmarks/bench_w4a16.py step ${STEP_ARGS:---configs rule --peer llama-3.2-1b,llama-3-8b,llama-3-70b} \
    --json "$OUT/step.json" 2>&1 | tee "$OUT/step.md"
  echo "step done at $((SECONDS - T0)) s"
fi
if part engine; then
  TARGET=${TARGET:-llama-3-70b}
  echo "== engine: 4-bit $TARGET target on one GPU"
  P="Write a quicksort in Python with comments explaining each step."
  source "$(dirname "${BASH_SOURCE[0]}")/../jobs/mps.sh"
  run() {   # name, ranks, args...
    local name=$1 n=$2; shift 2
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$RUNS/$name.mem" &
    local smi=$!
    timeout ${RUN_TIMEOUT:-170} $MPI -n $n $SW run --load-format dummy --quant int4 --target "$TARGET" \
      --device cuda --dtype bfloat16 --prompt "$P" --max-new-tokens 128 --ignore-eos \
      --out "$RUNS/$name.h5" --overwrite --quiet ${RUN_ARGS:-} "$@" > "$RUNS/$name.log" 2>&1 || tail -5 "$RUNS/$name.log"
    kill $smi 2>/dev/null; wait $smi 2>/dev/null
    $SW analyze "$RUNS/$name.h5" > "$RUNS/$name.txt" 2>&1
    echo "-- $name ($((SECONDS - T0)) s), GPU memory used at most $(sort -n "$RUNS/$name.mem" | tail -1) MiB"
    grep -E "tokens/s  |TTFT|mean accepted|verify: verify|draft: expand|decode|peak|memory" "$RUNS/$name.txt" | head -12
  }
  {
    run ar 1 --mode ar
    for d in ${DRAFTS-llama-3.2-3b llama-3.2-1b}; do
      run "sync-$d" 1 --mode sync --draft "$d"
      for pol in ${POLICIES:-rate}; do
        MPS=1 mps_start 2 1
        run "async-mps-$pol-$d" 2 --mode async --draft "$d" --async-policy "$pol"
        mps_stop
      done
      for m in sync ${POLICIES:-rate}; do
        [[ $m == sync ]] || m=async-mps-$m
        echo "   $m-$d vs ar:"; python3 benchmarks/compare_outputs.py "$RUNS/ar.h5" "$RUNS/$m-$d.h5" 2>&1 | tail -3
      done
    done
    d=$(echo ${DRAFTS-llama-3.2-3b} | cut -d' ' -f1)
    [[ -n "$d" ]] && { echo "   the target's top-2 logits at the first difference (sync-$d vs ar):"
      timeout 120 python3 benchmarks/compare_outputs.py "$RUNS/ar.h5" "$RUNS/sync-$d.h5" --target "$TARGET" \
        --quant int4 --dtype bfloat16 2>&1 | tail -2; }
  } 2>&1 | tee "$OUT/engine.txt"
fi
echo "all done at $((SECONDS - T0)) s"
