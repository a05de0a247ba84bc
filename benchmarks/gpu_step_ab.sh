#!/usr/bin/env bash
# Same-call A/B of a decode-step benchmark on the GPU machine (the 4-bit step unless BENCH says
# otherwise): this checkout against a baseline tree, alternated ROUNDS times in one call (figures
# move between machines and calls).
#   git archive <rev> | tar -x -C .cache/base_tree        # here, then carry .cache/base_tree
#   BASE_TREE=.cache/base_tree SHAPES=llama-3-8b,llama-3.2-1b bash benchmarks/gpu_step_ab.sh
# The baseline runs from its own tree (its Python and cuda/ sources, PYTHONPATH first) with this
# checkout's compiled extensions copied in (their sources must not differ between the two).
# STEP_ARGS go to both `bench_w4a16.py step` runs (default: the rule's variant, bf16 and int4 heads).
# BENCH replaces that command in both trees, e.g. the persistent step kernel beside the chain:
#   BASE_TREE=.cache/base_tree BENCH="python3 benchmarks/bench_step_kernel.py --rows 1b-bf16,1b-int4,8b-int4" \
#     bash benchmarks/gpu_step_ab.sh
# PRE (optional) runs first, after the build (e.g. a pytest line). Tables under $OUT/ab.md.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
BASE_TREE=$(cd "${BASE_TREE:?set BASE_TREE to a baseline tree}" && pwd)
SHAPES=${SHAPES:-llama-3-8b,llama-3.2-1b}
ROUNDS=${ROUNDS:-2}
BENCH=${BENCH:-python3 benchmarks/bench_w4a16.py step --shapes $SHAPES ${STEP_ARGS:---configs rule}}
T0=$SECONDS
python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
for so in $(cd swiftspec_mpi && find . -name "*.so"); do cp "swiftspec_mpi/$so" "$BASE_TREE/swiftspec_mpi/$so"; done
echo "installed at $((SECONDS - T0)) s"
if [[ -n "${PRE:-}" ]]; then
  bash -c "$PRE" 2>&1 | tail -15 | tee "$OUT/pre.txt"
  echo "pre done at $((SECONDS - T0)) s"
fi
here=$(pwd)
for r in $(seq 1 "$ROUNDS"); do
  for side in new base; do
    if [[ $side == new ]]; then dir=$here; pp=${PYTHONPATH:-}; else dir=$BASE_TREE; pp=$BASE_TREE; fi
    echo "== round $r, $side ($dir)" | tee -a "$OUT/ab.md"
    (cd "$dir" && PYTHONPATH=$pp timeout ${STEP_TIMEOUT:-240} bash -c "$BENCH" 2>&1 | grep -E "^\||rror" \
        | tee -a "$OUT/ab.md")
    echo "   ($((SECONDS - T0)) s)"
  done
done
echo "all done at $((SECONDS - T0)) s"
