#!/bin/bash
# swiftspec-mpi on a workstation (no Slurm): mpiexec starts NP ranks on this machine.
#
#   jobs/mpirun-local.sh                                      # 2 ranks, async, the default prompt
#   PROMPT="Write a limerick about caches." jobs/mpirun-local.sh --temperature 0.7
#   NP=4 DRAFT_RANKS=1 PROMPTS=prompts.jsonl jobs/mpirun-local.sh
#   MODE=ar NP=1 jobs/mpirun-local.sh                         # the plain baseline
#
# Usage: jobs/mpirun-local.sh [more `swiftspec run` flags...]
# The MPI library is the one mpi4py was built against: the `mpich` wheel's mpiexec (hydra) in the
# venv by default. With Open MPI use its mpirun (MPIEXEC=mpirun); add --oversubscribe there when NP
# exceeds the cores. Cores: each rank gets cores/NP torch threads and pins itself to them, so leave
# mpiexec's own binding off (MPICH's default; Open MPI: --bind-to none).
set -euo pipefail

# ---------------------------------------------------------------------------------------------
# Knobs (environment variables). Empty = the engine's own default.
# ---------------------------------------------------------------------------------------------
NP=${NP:-2}                                 # MPI ranks (async: verify + draft, >= 2)
MODE=${MODE:-async}                         # async | sync | ar
DRAFT_RANKS=${DRAFT_RANKS:-}                # async: ranks of the draft group (empty: 1 up to 4 ranks, else NP/4)
SWIFTSPEC_TARGET=${SWIFTSPEC_TARGET:-}      # target model: HF folder, .gguf file or registry name (empty: embedded default)
SWIFTSPEC_DRAFT=${SWIFTSPEC_DRAFT:-}        # draft model, same forms (empty: embedded default)
PROMPTS=${PROMPTS:-}                        # JSONL file of prompts; when empty, PROMPT is used
PROMPT=${PROMPT:-Explain speculative decoding in two sentences.}   # one prompt (when PROMPTS is empty)
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}       # tokens generated per prompt
TEMPERATURE=${TEMPERATURE:-0}               # 0 = greedy
SEED=${SEED:-0}                             # sampling seed
DTYPE=${DTYPE:-float32}                     # float32 | bfloat16
DEVICE=${DEVICE:-auto}                      # auto | cpu | cuda (GPU local_rank % ngpus)
THREADS=${THREADS:-}                        # torch threads per rank (empty: cores / NP)
CHAT=${CHAT:-0}                             # 1 = chat template (--chat)
OUT=${OUT:-runs/swiftspec-local-$(date +%Y%m%d-%H%M%S).h5}   # HDF5 trace
OVERWRITE=${OVERWRITE:-0}                   # 1 = replace an existing OUT
MPS=${MPS:-auto}                            # CUDA MPS daemon for ranks that share a GPU (jobs/mps.sh): auto = when
                                            # NP exceeds the GPUs and DEVICE is not cpu, 1 = always, 0 = never
MPS_PROBE=${MPS_PROBE:-1}                   # 1: a daemon we start is first tried by one CUDA client (stopped if it fails), 0: no check
if [[ -z ${SWIFTSPEC_VENV+set} ]]; then     # venv with swiftspec-mpi: default the checkout's .venv if present
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    [[ -x $here/.venv/bin/swiftspec ]] && SWIFTSPEC_VENV=$here/.venv
fi
SWIFTSPEC_VENV=${SWIFTSPEC_VENV:-}          # "" = swiftspec and mpiexec from PATH

die() { echo "mpirun-local.sh: error: $*" >&2; exit 2; }
if [[ -n $SWIFTSPEC_VENV ]]; then
    [[ -x $SWIFTSPEC_VENV/bin/swiftspec ]] || die "$SWIFTSPEC_VENV/bin/swiftspec not found; set SWIFTSPEC_VENV"
    export VIRTUAL_ENV=$SWIFTSPEC_VENV PATH=$SWIFTSPEC_VENV/bin:$PATH
fi
MPIEXEC=${MPIEXEC:-mpiexec}                 # launcher: the venv's (the mpich wheel's hydra) comes first on PATH
MPIEXEC_ARGS=${MPIEXEC_ARGS:-}              # launcher flags, split on spaces (Open MPI: "--oversubscribe --bind-to none")
command -v swiftspec >/dev/null || die "no swiftspec on PATH; install swiftspec-mpi or set SWIFTSPEC_VENV"
command -v "$MPIEXEC" >/dev/null || die "no $MPIEXEC on PATH; pip install mpich (or set MPIEXEC)"
mkdir -p "$(dirname "$OUT")"

args=(run --mode "$MODE" --max-new-tokens "$MAX_NEW_TOKENS" --temperature "$TEMPERATURE"
      --seed "$SEED" --dtype "$DTYPE" --device "$DEVICE" --out "$OUT")
if [[ -n $PROMPTS ]]; then args+=(--prompts "$PROMPTS"); else args+=(--prompt "$PROMPT"); fi
[[ -n $THREADS ]] && args+=(--threads "$THREADS")
[[ -n $SWIFTSPEC_TARGET ]] && args+=(--target "$SWIFTSPEC_TARGET")
[[ -n $SWIFTSPEC_DRAFT ]] && args+=(--draft "$SWIFTSPEC_DRAFT")
[[ $MODE == async && -n $DRAFT_RANKS ]] && args+=(--draft-ranks "$DRAFT_RANKS")
[[ $CHAT == 1 ]] && args+=(--chat)
[[ $OVERWRITE == 1 ]] && args+=(--overwrite)
args+=("$@")

read -r -a launcher_args <<< "$MPIEXEC_ARGS"
source "$(dirname "${BASH_SOURCE[0]}")/mps.sh"
[[ $DEVICE == cpu && $MPS == auto ]] || mps_start "$NP" "$(mps_gpu_count)"
echo "+ $MPIEXEC -n $NP ${MPIEXEC_ARGS:+$MPIEXEC_ARGS }swiftspec $(printf '%q ' "${args[@]}")" >&2
# Ctrl-C: mpiexec forwards SIGINT to the ranks; they finish the step, write OUT and exit non-zero.
mps_exec "$MPIEXEC" -n "$NP" "${launcher_args[@]}" swiftspec "${args[@]}"
