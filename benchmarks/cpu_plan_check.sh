#!/usr/bin/env bash
# How far `swiftspec plan`'s predicted tok/s is from the measured run on CPU ranks: the tiny pair
# of `swiftspec tiny-checkpoint` on dummy weights, acceptance replayed from MODEL (default the
# real Qwen pair's); plan on RANKS (default 2) ranks, then its chosen configuration and the best
# row of the other mode, each run REPS (default 3) times (400 new tokens of one prompt; plan
# --context 200, their middle), and
# benchmarks/plan_check.py: predicted against measured, run by run.
#   bash benchmarks/cpu_plan_check.sh [OUT]          (about a minute on 2 idle cores)
# Summary: OUT/plan-check.md; plan OUT/plan.{json,txt}.
set -u
OUT=${1:-/tmp/cpu_plan_check}; mkdir -p "$OUT"
RANKS=${RANKS:-2}; REPS=${REPS:-3}
MODEL=${MODEL:-benchmarks/acceptance/qwen25coder-0.5b-1.5b.json}
export OMP_NUM_THREADS=1 SWIFTSPEC_NO_PIN=1
SW="python3 -m swiftspec_mpi"
[[ -d "$OUT/tiny/target" ]] || $SW tiny-checkpoint "$OUT/tiny" > /dev/null
PAIR=(--target "$OUT/tiny/target" --draft "$OUT/tiny/draft" --threads 1)
mpiexec -n "$RANKS" $SW plan "${PAIR[@]}" --accept-from "$MODEL" --max-expansions 4 --context 200 --json \
  > "$OUT/plan.json"
python3 - "$OUT/plan.json" > "$OUT/configs.txt" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
c = r["chosen"]
other = next(x for x in r["table"] if x["mode"] != c["mode"])
for x in (c, other):
    n = x["verify_ranks"] + x["draft_ranks"]
    pace = f" --expansions {x['expansions']}" if x["mode"] == "sync" or x["shared_device"] else ""
    extra = f" --draft-ranks {x['draft_ranks']}" if x["mode"] == "async" else ""
    print(f"{n} --mode {x['mode']}{extra} --verify-size {x['verify_size']} --tree-width {x['tree_width']}{pace}")
PY
i=0
while read -r n flags; do
  for rep in $(seq 1 "$REPS"); do
    mpiexec -n "$n" $SW run "${PAIR[@]}" --load-format dummy --accept-from "$MODEL" $flags --prompt "def fib(n):" \
      --max-new-tokens 400 --ignore-eos --quiet --overwrite --out "$OUT/run$i-$rep.h5" 2> "$OUT/run$i-$rep.log" \
      < /dev/null || tail -3 "$OUT/run$i-$rep.log"
  done
  i=$((i + 1))
done < "$OUT/configs.txt"
python3 benchmarks/plan_check.py "$OUT/plan.json" "$OUT"/run*.h5 --json "$OUT/plan-check.json" | tee "$OUT/plan-check.md"
