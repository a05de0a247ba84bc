#!/usr/bin/env bash
# Compile-only check of every cuda/*.cu for Hopper (what CI runs; the GPU machine compiles the
# same sources at run time through cupy.RawModule). Exits non-zero if any compile fails.
#
#   tools/compile_cuda.sh            # cubins go to a temp dir and are discarded
#   VERBOSE=1 tools/compile_cuda.sh  # also print ptxas' registers / spills / shared memory
#   CUBIN_DIR=dir tools/compile_cuda.sh  # keep the cubins there
#
# Flags: nvcc -arch=sm_90 -std=c++17 -O3 --cubin, plus -I<NCCL include> -DSWIFTSPEC_WITH_NCCL for
# the fused GEMM + all-reduce (gemm_allreduce.cu is also compiled without NCCL, as kernels.py
# does for the plain GEMM). The NCCL headers (nccl.h + nccl_device.h, NCCL >= 2.28) are taken
# from, in order: $NCCL_INCLUDE; the nvidia-nccl-cu12/cu13 wheel of $PYTHON (default: the
# checkout's .venv, else python3); $CUDA_HOME/include or /usr/include; else the headers of
# nvidia-nccl-cu13==$NCCL_PIN (default 2.28.9) fetched once with `pip download` into
# .cache/nccl-headers/ (git-ignored). Prints "NCCL include: <dir>" for the tests.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
NVCC=${NVCC:-nvcc}
NCCL_PIN=${NCCL_PIN:-2.28.9}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
command -v "$NVCC" >/dev/null || { echo "compile_cuda.sh: $NVCC not found (set NVCC or PATH)" >&2; exit 2; }

find_nccl_include() {
  if [[ -n "${NCCL_INCLUDE:-}" ]]; then echo "$NCCL_INCLUDE"; return; fi
  local d
  d=$("$PYTHON" - "$ROOT/swiftspec_mpi/gpu/nccl_shim.py" <<'EOF' 2>/dev/null || true
import importlib.util, sys
spec = importlib.util.spec_from_file_location("nccl_shim", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
print(m.nccl_include_dir() or "")
EOF
)
  if [[ -n "$d" ]]; then echo "$d"; return; fi
  local cache="$ROOT/.cache/nccl-headers/$NCCL_PIN"
  if [[ ! -f "$cache/include/nccl_device.h" ]]; then
    local tmp
    tmp=$(mktemp -d)
    echo "compile_cuda.sh: fetching NCCL $NCCL_PIN headers (pip download nvidia-nccl-cu13==$NCCL_PIN)" >&2
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "nvidia-nccl-cu13==$NCCL_PIN" -d "$tmp" >&2
    mkdir -p "$cache"
    "$PYTHON" - "$tmp" "$cache" <<'EOF'
import glob, os, sys, zipfile
whl = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    for n in z.namelist():
        if n.startswith("nvidia/nccl/include/") and not n.endswith("/"):
            dst = os.path.join(sys.argv[2], "include", n[len("nvidia/nccl/include/"):])
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "wb") as f:
                f.write(z.read(n))
EOF
    rm -rf "$tmp"
  fi
  echo "$cache/include"
}

NCCL_INC=$(find_nccl_include)
[[ -f "$NCCL_INC/nccl_device.h" ]] || { echo "compile_cuda.sh: no nccl_device.h in '$NCCL_INC'" >&2; exit 2; }
echo "NCCL include: $NCCL_INC"

if [[ -n "${CUBIN_DIR:-}" ]]; then   # keep the cubins (e.g. for cuobjdump -sass)
  OUTDIR=$CUBIN_DIR
  mkdir -p "$OUTDIR"
else
  OUTDIR=$(mktemp -d)
  trap 'rm -rf "$OUTDIR"' EXIT
fi
FLAGS=(-arch=sm_90 -std=c++17 -O3 --cubin)
[[ -n "${VERBOSE:-}" ]] && FLAGS+=(-Xptxas -v)

jobs_pids=()
jobs_names=()
start() {  # name, args...
  local name=$1; shift
  ( "$NVCC" "${FLAGS[@]}" "$@" >"$OUTDIR/$name.log" 2>&1 ) &
  jobs_pids+=($!)
  jobs_names+=("$name")
}
for cu in "$ROOT"/cuda/*.cu; do
  base=$(basename "$cu" .cu)
  start "$base" "$cu" -o "$OUTDIR/$base.cubin"
  if grep -q SWIFTSPEC_WITH_NCCL "$cu"; then
    start "$base+nccl" -I"$NCCL_INC" -DSWIFTSPEC_WITH_NCCL "$cu" -o "$OUTDIR/$base+nccl.cubin"
  fi
done

fail=0
for i in "${!jobs_pids[@]}"; do
  if wait "${jobs_pids[$i]}"; then
    echo "ok   ${jobs_names[$i]}"
    [[ -n "${VERBOSE:-}" ]] && grep -E "Compiling entry|registers|spill" "$OUTDIR/${jobs_names[$i]}.log" | sed 's/^/     /'
  else
    echo "FAIL ${jobs_names[$i]}"
    sed 's/^/     /' "$OUTDIR/${jobs_names[$i]}.log"
    fail=1
  fi
done
exit $fail
