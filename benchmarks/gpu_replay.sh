#!/usr/bin/env bash
# What speculation earns on one H200 at real acceptance: random weights at real shapes, the
# target's choices replayed from an acceptance model (run --accept-from, engine/replay.py).
#   run via the device tool:  bash benchmarks/gpu_replay.sh      (results under $OUT, 6-8 min)
# PARTS picks what runs, in this order, each run in its own `timeout`, a failure going on to the
# next (default "plan70 paper70 int8b bf8b"):
#   plan70  swiftspec plan for this GPU (2 ranks, MPS; Llama-3-70B int4 target + Llama-3.2-1B
#           int4 draft at the real Qwen2.5-Coder 0.5B -> 1.5B pair's acceptance; its step times
#           with the measured host term, its predicted tok/s and those for 2, 4, 8 GPUs of this
#           kind), then the configuration it chose, run, and benchmarks/plan_check.py: predicted
#           against measured;
#   paper70 the same 70B + 1B: ar, sync and async (2 ranks under MPS, the draft paced) at the
#           acceptance the SwiftSpec paper reports;
#   int8b   Llama-3-8B int4 + 1B int4: ar, sync, async at the real pair's acceptance;
#   bf8b    Llama-3-8B bf16 + 1B bf16: async, then ar, at the real pair's acceptance;
#   real70  70B int4 + 1B int4 ar, sync, async at the real pair's acceptance (plan_check'd too).
# Summaries: $OUT/replay.md (benchmarks/replay_summary.py), $OUT/plan-70b.{txt,json},
# $OUT/plan-check.md; traces $OUT/*.h5, logs $OUT/*.log. BUDGET (s, default 330) skips what
# would start after it; RUN_TIMEOUT (s, default 90) bounds each run, PLAN_TIMEOUT (default 240),
# so the script ends within BUDGET + 90 s + the summary (under the device call's 600 s); MAX_NEW
# (default 128) tokens a request.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/../jobs/mps.sh"
T0=$SECONDS
BUDGET=${BUDGET:-330}
RUN_TIMEOUT=${RUN_TIMEOUT:-90}
MAX_NEW=${MAX_NEW:-128}
PLAN_TIMEOUT=${PLAN_TIMEOUT:-240}
PARTS=${PARTS:-"plan70 paper70 int8b bf8b"}
REAL=benchmarks/acceptance/qwen25coder-0.5b-1.5b.json
PAPER=benchmarks/acceptance/swiftspec-paper.json
P="Write a quicksort in Python with comments explaining each step."
COMMON="--load-format dummy --device cuda --dtype bfloat16 --prompt \"$P\" --max-new-tokens $MAX_NEW --ignore-eos --quiet --overwrite"
M70="--target llama-3-70b --draft llama-3.2-1b --quant int4"
M8="--target llama-3-8b --draft llama-3.2-1b"
M8Q="--target llama-3-8b --draft llama-3.2-1b --quant int4"

part() { [[ " $PARTS " == *" $1 "* ]]; }
left() { (( SECONDS - T0 < BUDGET )) || { echo "-- skipped (budget of $BUDGET s spent): $*"; return 1; }; }
run() {  # name ranks args...: one run, its own timeout; the trace in $OUT/name.h5
  local name=$1 n=$2; shift 2
  left "$name" || return 0
  eval timeout "$RUN_TIMEOUT" $MPI -n "$n" $SW run $COMMON --out "$OUT/$name.h5" "$@" > "$OUT/$name.log" 2>&1 \
    || { echo "-- $name failed or timed out:"; tail -3 "$OUT/$name.log"; }
  echo "-- $name done at $((SECONDS - T0)) s"
}
async_mps() {  # name args...: async on 2 ranks sharing the GPU through MPS (paced by default)
  local name=$1; shift
  left "$name" || return 0
  MPS=1 mps_start 2 1
  run "$name" 2 --mode async "$@"
  mps_stop
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
timeout 150 python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 \
  || { echo "install failed:"; tail -20 "$OUT/install.log"; exit 1; }
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null

# the plan for this GPU (2 ranks under MPS; its tables also predict 2..8 GPUs like it), then its choice
if part plan70 && left plan; then
  MPS=1 mps_start 2 1
  timeout "$PLAN_TIMEOUT" $MPI -n 2 $SW plan --load-format dummy --device cuda --dtype bfloat16 $M70 \
    --accept-from $REAL --gpus 8 --context 80 --json > "$OUT/plan-70b.json" 2> "$OUT/plan-70b.log" \
    || { echo "-- plan failed or timed out:"; tail -3 "$OUT/plan-70b.log"; }
  mps_stop
  echo "-- plan done at $((SECONDS - T0)) s"
  python3 - "$OUT/plan-70b.json" > "$OUT/plan-70b.txt" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
c = r["chosen"]
print(f"1 GPU: chosen {c['mode']} draft {c['draft_ranks']} / verify {c['verify_ranks']} n={c['verify_size']} "
      f"w={c['tree_width']} d={c['expansions']}: predicted {c['tok_s']:.1f} tok/s ({c['tokens_per_step']:.2f} "
      f"tokens a step, {c['step_ms']:.2f} ms of which host {c['host_ms']:.2f}); t_target {r['t_target_s']}, "
      f"t_draft {r['t_draft_s']}")
print(f"host, ar: {1e3 * r.get('host_ar_s', 0):.3f} ms a token")
for n, h in sorted(r.get("host_s", {}).items(), key=lambda kv: int(kv[0])):
    print(f"host, sync n={n}: {1e3 * h['step_s']:.3f} ms a step + {1e3 * h['expansion_s']:.3f} ms an expansion; "
          f"loop measured (d: [s a step, draft forwards a step, tokens a step]) {h['measured']}")
for D, rows in r.get("host_async_s", {}).items():
    for n, h in sorted(rows.items(), key=lambda kv: int(kv[0])):
        print(f"host, async {D} draft rank(s) n={n}: {1e3 * h['step_s']:.3f} ms a step + {1e3 * h['expansion_s']:.3f} "
              f"ms an expansion; loop measured (pace: [s a step, tokens a step]) {h['measured']}")
for n, p in sorted(r.get("predicted", {}).items(), key=lambda kv: int(kv[0])):
    b, s, a = p["chosen"], p.get("best_sync"), p.get("best_async")
    print(f"{n} GPU(s): ar {p['ar_tok_s']:.1f}; best {b['mode']} draft {b['draft_ranks']} / verify "
          f"{b['verify_ranks']} n={b['verify_size']} d={b['expansions']} {b['tok_s']:.1f} tok/s; "
          f"best sync {s['tok_s'] if s else '-'}; best async {a['tok_s'] if a else '-'}")
PY
  cat "$OUT/plan-70b.txt"
  CHOSEN=$(python3 -c "
import json, sys
c = json.load(open(sys.argv[1]))['chosen']
flags = f\"--verify-size {c['verify_size']} --tree-width {c['tree_width']} --expansions {c['expansions']}\"
print(('sync 1 ' if c['mode'] == 'sync' else 'async 2 ') + flags)" "$OUT/plan-70b.json" 2>/dev/null)
  if [[ -n "$CHOSEN" ]]; then
    set -- $CHOSEN
    mode=$1; shift 2
    if [[ $mode == sync ]]; then run 70b-planned 1 --mode sync $M70 --accept-from $REAL "$@"
    else async_mps 70b-planned $M70 --accept-from $REAL "$@"; fi
  fi
fi

# 70B at the paper's acceptance, with its own ar
if part paper70; then
  run 70b-ar 1 --mode ar $M70
  run 70b-sync-paper 1 --mode sync $M70 --accept-from $PAPER
  async_mps 70b-async-paper $M70 --accept-from $PAPER
fi

# 8B int4 + 1B int4 at the real pair's acceptance
if part int8b; then
  run 8bq-ar 1 --mode ar $M8Q
  run 8bq-sync 1 --mode sync $M8Q --accept-from $REAL
  async_mps 8bq-async $M8Q --accept-from $REAL
fi

# 8B bf16 + 1B bf16: async (sync and ar were measured at aeb174a), then its ar
if part bf8b; then
  async_mps 8b-async $M8 --accept-from $REAL
  run 8b-ar 1 --mode ar $M8
fi

# 70B at the real pair's acceptance (measured at aeb174a)
if part real70; then
  part paper70 || run 70b-ar 1 --mode ar $M70
  run 70b-sync 1 --mode sync $M70 --accept-from $REAL
  async_mps 70b-async $M70 --accept-from $REAL
fi

if [[ -s "$OUT/plan-70b.json" ]]; then
  python3 benchmarks/plan_check.py "$OUT/plan-70b.json" $(ls "$OUT"/70b-planned.h5 "$OUT"/70b-sync.h5 \
    "$OUT"/70b-async.h5 2>/dev/null) --json "$OUT/plan-check.json" > "$OUT/plan-check.md" 2>&1 || true
  cat "$OUT/plan-check.md"
fi
python3 benchmarks/replay_summary.py "$OUT"/*.h5 --json "$OUT/replay.json" | tee "$OUT/replay.md"
echo "all done at $((SECONDS - T0)) s"
