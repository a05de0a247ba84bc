# swiftspec-mpi: a CUDA MPS daemon for the ranks of one job that share a GPU. Sourced by
# generate-gpu.sbatch, interactive.sh and mpirun-local.sh; not run on its own.
#
# Why: two processes on one GPU take turns on it (time slicing), so an async draft rank and verify
# rank that share a GPU never run at the same time. The Multi-Process Service runs their kernels
# concurrently: 8B verify + 1B draft on one H200, async 80 tok/s without MPS, 111 with
# (docs/benchmarks.md, "GPU engine"; docs/slurm.md, "Ranks that share a GPU").
#
#   source jobs/mps.sh
#   mps_start "$NRANKS" "$NGPUS"     # MPS=auto (default): start one when NRANKS > NGPUS > 0
#   ...launch the ranks...           # they inherit CUDA_MPS_PIPE_DIRECTORY / _LOG_DIRECTORY
#   mps_stop                         # also registered on EXIT; stops only a daemon we started
#   mps_exec mpiexec -n 2 ...        # or, as the script's last command: exec the launcher, or
#                                    # run it and stop the daemon after it when we started one
#
# MPS=1 starts one whenever nvidia-cuda-mps-control is on PATH, MPS=0 never. A daemon we start
# is first tried by one CUDA client (MPS_PROBE=1, the default); if that fails, it is stopped and
# the job runs without MPS, with a warning. A daemon that
# already listens where CUDA clients look (CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps: a
# site-wide one) is used as it is. Ours keeps its pipe and log folders under
# ${TMPDIR:-/tmp}/swiftspec-mps-<job id or pid>/ (/tmp when TMPDIR is long; the log stays).

MPS=${MPS:-auto}                            # auto | 1 | 0 (see above)
MPS_PROBE=${MPS_PROBE:-1}                   # 1: check that a CUDA client can use the daemon we start
_mps_started=0

# Can a CUDA client use the MPS daemon? Its server starts lazily, at the first client, and can
# still fail there (a GPU held by another MPS server or in a mode MPS may not use): then every
# rank's CUDA init would fail. One client of our own first: the primary context of the first
# visible GPU through the driver API (python3's ctypes, ~0.3 s). Silent; status 0 when it worked.
_mps_probe() {
    python3 - 2>/dev/null <<'PY'
import ctypes, sys
try:
    cu = ctypes.CDLL("libcuda.so.1")
except OSError:
    sys.exit(1)
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
ok = cu.cuInit(0) == 0 and cu.cuDeviceGet(ctypes.byref(dev), 0) == 0 \
    and cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
if ok:
    cu.cuDevicePrimaryCtxRelease_v2(dev)
sys.exit(0 if ok else 1)
PY
}

# The GPUs this job may use: the entries of CUDA_VISIBLE_DEVICES, else what nvidia-smi lists.
mps_gpu_count() {
    if [[ -n ${CUDA_VISIBLE_DEVICES:-} ]]; then
        local -a ids
        IFS=, read -r -a ids <<< "$CUDA_VISIBLE_DEVICES"
        echo "${#ids[@]}"
    elif command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else
        echo 0
    fi
}

mps_start() {   # NRANKS NGPUS
    local nranks=$1 ngpus=$2
    case $MPS in
        0) return 0 ;;
        1) ;;
        auto) (( ngpus > 0 && nranks > ngpus )) || return 0 ;;
        *) echo "mps.sh: MPS must be auto, 1 or 0, not '$MPS'" >&2; return 2 ;;
    esac
    if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
        echo "mps.sh: warning: $nranks ranks on $ngpus GPU(s) but nvidia-cuda-mps-control is not on PATH:" \
             "ranks that share a GPU will take turns on it (MPS=0 silences this)" >&2
        return 0
    fi
    local existing=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/nvidia-mps}    # where CUDA clients look
    if [[ -e $existing/control ]]; then
        echo "mps.sh: using the MPS daemon already at $existing" >&2
        return 0
    fi
    local base=${TMPDIR:-/tmp}
    (( ${#base} <= 60 )) || base=/tmp           # the daemon's sockets need a short path
    base=$base/swiftspec-mps-${SLURM_JOB_ID:-$$}
    export CUDA_MPS_PIPE_DIRECTORY=$base/pipe CUDA_MPS_LOG_DIRECTORY=$base/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
        _mps_started=1
        trap mps_stop EXIT
        if [[ $MPS_PROBE == 1 ]] && ! _mps_probe; then
            echo "mps.sh: warning: the CUDA MPS daemon started but a CUDA client could not use it" \
                 "(log: $CUDA_MPS_LOG_DIRECTORY); running without MPS: ranks that share a GPU will take" \
                 "turns on it (MPS=0 skips the daemon, MPS_PROBE=0 this check)" >&2
            mps_stop 2>/dev/null
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
            return 0
        fi
        echo "mps.sh: started a CUDA MPS daemon for $nranks ranks on $ngpus GPU(s) (pipe $CUDA_MPS_PIPE_DIRECTORY)" >&2
    else
        echo "mps.sh: warning: nvidia-cuda-mps-control -d failed (log: $CUDA_MPS_LOG_DIRECTORY);" \
             "ranks that share a GPU will take turns on it" >&2
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
}

mps_stop() {
    if [[ $_mps_started == 1 ]]; then
        _mps_started=0
        echo quit | nvidia-cuda-mps-control || true
        rm -rf "$CUDA_MPS_PIPE_DIRECTORY"
        echo "mps.sh: stopped the CUDA MPS daemon (log: $CUDA_MPS_LOG_DIRECTORY)" >&2
    fi
}

# The script's last command: exec "$@" as before, or, when mps_start started a daemon, run it in
# the foreground (Ctrl-C still reaches the launcher and its ranks) and exit with its status, the
# EXIT trap stopping the daemon.
mps_exec() {
    [[ $_mps_started == 1 ]] || exec "$@"
    trap 'exit 130' INT
    local rc=0
    "$@" || rc=$?
    exit "$rc"
}

