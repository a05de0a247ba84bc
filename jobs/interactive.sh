#!/bin/bash
# swiftspec-mpi interactively: a chat session on models loaded once (no prompt given), or one
# prompt; the text is streamed to your terminal.
#
# On a cluster: get an allocation, then run this inside it (it launches the ranks with srun):
#
#   salloc --nodes=1 --ntasks=2 --cpus-per-task=4 --time=00:30:00      # a shell inside the allocation
#   jobs/interactive.sh                  # a session: type a prompt, Enter; /reset, /help; Ctrl-D ends
#   jobs/interactive.sh "Explain speculative decoding in two sentences."   # one prompt
#   MODE=ar jobs/interactive.sh "Same prompt, plain decoding, to compare tokens/s"
#   exit                                                                # give the allocation back
#
#   # or in one go (salloc runs the script, then frees the allocation):
#   salloc -N1 -n2 -c4 -t 10 jobs/interactive.sh "Write a haiku about MPI." --temperature 0.7
#
#   # GPU node: salloc -N1 --gpus-per-node=2 --ntasks-per-node=2 -c4, then DEVICE=cuda DTYPE=bfloat16 jobs/interactive.sh "..."
#
# On a workstation (no Slurm), the same run is plain mpiexec; see jobs/mpirun-local.sh:
#
#   .venv/bin/mpiexec -n 2 .venv/bin/swiftspec run --mode async --prompt "Hello"
#
# Usage: jobs/interactive.sh [PROMPT|-] [more `swiftspec run` flags...]
# Every rank runs `swiftspec run`; world rank 0 (the verify leader) prints the text as it is accepted.
# Without a PROMPT (or with "-") the ranks run `swiftspec run --interactive`: srun hands your
# terminal's input to task 0 only (--input=0), which reads one prompt a line until end of input
# (Ctrl-D) or /exit; with CHAT=1 the prompts form one conversation. A program can pipe its
# prompts in the same way: printf '%s\n' "first" "second" | jobs/interactive.sh
set -euo pipefail

# ---------------------------------------------------------------------------------------------
# Knobs (environment variables). Empty = the engine's own default.
# ---------------------------------------------------------------------------------------------
PROMPT=${1:-${PROMPT:--}}                   # the text to continue; "-" = a session on standard input
shift $(( $# > 0 ? 1 : 0 ))                 # the rest of the arguments go to swiftspec run as they are
SWIFTSPEC_TARGET=${SWIFTSPEC_TARGET:-}      # target model: HF folder, .gguf file or registry name (empty: embedded default)
SWIFTSPEC_DRAFT=${SWIFTSPEC_DRAFT:-}        # draft model, same forms (empty: embedded default)
MODE=${MODE:-async}                         # async | sync | ar
DRAFT_RANKS=${DRAFT_RANKS:-}                # async: ranks of the draft group (empty: engine default)
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-128}       # tokens to generate
TEMPERATURE=${TEMPERATURE:-0}               # 0 = greedy
SEED=${SEED:-0}                             # sampling seed
DTYPE=${DTYPE:-float32}                     # float32 | bfloat16
DEVICE=${DEVICE:-auto}                      # auto | cpu | cuda
THREADS=${THREADS:-${SLURM_CPUS_PER_TASK:-1}}   # torch threads per rank
CHAT=${CHAT:-1}                             # 1 = chat template (instruct models answer the prompt); 0 = raw continuation
OUT=${OUT:-runs/interactive-${SLURM_JOB_ID:-local}-$(date +%Y%m%d-%H%M%S).h5}   # HDF5 trace of this run
SRUN_MPI=${SRUN_MPI:-pmi2}                  # pmi2 for MPICH (the mpich wheel, default); pmix for Open MPI
MPS=${MPS:-auto}                            # CUDA MPS daemon for ranks that share a GPU (jobs/mps.sh): auto = when
                                            # the allocation has more tasks than GPUs, 1 = always, 0 = never
MPS_PROBE=${MPS_PROBE:-1}                   # 1: a daemon we start is first tried by one CUDA client (stopped if it fails), 0: no check
if [[ -z ${SWIFTSPEC_VENV+set} ]]; then     # venv with swiftspec-mpi: default the checkout's .venv if present
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
    [[ -x $here/.venv/bin/swiftspec ]] && SWIFTSPEC_VENV=$here/.venv
fi
SWIFTSPEC_VENV=${SWIFTSPEC_VENV:-}          # "" = swiftspec from PATH

die() { echo "interactive.sh: error: $*" >&2; exit 2; }
if [[ -n $SWIFTSPEC_VENV ]]; then
    [[ -x $SWIFTSPEC_VENV/bin/swiftspec ]] || die "$SWIFTSPEC_VENV/bin/swiftspec not found; set SWIFTSPEC_VENV"
    export VIRTUAL_ENV=$SWIFTSPEC_VENV PATH=$SWIFTSPEC_VENV/bin:$PATH
fi
command -v swiftspec >/dev/null || die "no swiftspec on PATH; install swiftspec-mpi or set SWIFTSPEC_VENV"
[[ -n ${SLURM_JOB_ID:-} ]] || die "no Slurm allocation here; run 'salloc -n 2 ...' first, or use jobs/mpirun-local.sh on a workstation"
ntasks=${SLURM_NTASKS:-1}
mkdir -p "$(dirname "$OUT")"

if [[ $PROMPT == - ]]; then
    args=(run --interactive); input=(--input=0)    # stdin to task 0 (rank 0) only
else
    args=(run --prompt "$PROMPT"); input=()
fi
args+=(--mode "$MODE" --max-new-tokens "$MAX_NEW_TOKENS"
       --temperature "$TEMPERATURE" --seed "$SEED" --dtype "$DTYPE" --device "$DEVICE"
       --threads "$THREADS" --out "$OUT")
[[ -n $SWIFTSPEC_TARGET ]] && args+=(--target "$SWIFTSPEC_TARGET")
[[ -n $SWIFTSPEC_DRAFT ]] && args+=(--draft "$SWIFTSPEC_DRAFT")
[[ $MODE == async && -n $DRAFT_RANKS ]] && args+=(--draft-ranks "$DRAFT_RANKS")
[[ $CHAT == 1 ]] && args+=(--chat)
args+=("$@")

source "$(dirname "${BASH_SOURCE[0]}")/mps.sh"
[[ $DEVICE == cpu && $MPS == auto ]] || mps_start "$ntasks" "$(mps_gpu_count)"

# --ntasks: every task of the allocation; --unbuffered: stream each token as the leader prints it;
# --kill-on-bad-exit=1: one failing rank ends them all; --quit-on-interrupt: ONE Ctrl-C sends
# SIGINT to the ranks (without it srun only prints task states and needs a second Ctrl-C), the
# engine finishes the step, writes OUT and exits; a second Ctrl-C makes srun kill them at once.
mps_exec srun --mpi="$SRUN_MPI" --ntasks="$ntasks" --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}" \
    --unbuffered --kill-on-bad-exit=1 --quit-on-interrupt "${input[@]}" swiftspec "${args[@]}"
