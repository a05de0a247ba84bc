#!/usr/bin/env bash
# Time to first token of the engine on the GPU machine: `ar`, `sync` and `async` (both ranks on
# one GPU under CUDA MPS), 8B dummy target + 1B dummy draft, four Spec-Bench prompts of 17-1313
# tokens (benchmarks/prompts_ttft4.jsonl), 64 new tokens; prints per-request TTFT and tokens/s,
# the late graph captures per rank and the warm-up record. Results under $OUT.
#
#   bash benchmarks/gpu_ttft_runs.sh                      # this checkout (installs it first)
#   OLD=/path/to/other/checkout bash benchmarks/gpu_ttft_runs.sh   # that one first, then this (A/B)
#
# e.g. OLD=out/old after `mkdir -p out/old && git archive <commit> | tar -x -C out/old`.
set -u
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n "${OLD:-}" ]]; then OLD=$(cd "$OLD" && pwd) || exit 1; fi
P=$ROOT/benchmarks/prompts_ttft4.jsonl
source "$ROOT/jobs/mps.sh"
run() {   # tag mode nranks
  timeout 200 $MPI -n $3 $SW run --load-format dummy --target llama-3-8b --draft llama-3.2-1b \
    --mode $2 --device cuda --dtype bfloat16 --prompts "$P" --max-new-tokens 64 --ignore-eos \
    --out "$OUT/ttft-$1-$2.h5" --overwrite --quiet > "$OUT/ttft-$1-$2.log" 2>&1 || tail -5 "$OUT/ttft-$1-$2.log"
  python3 - "$OUT/ttft-$1-$2.h5" "$1 $2" <<'PY'
import json, sys
import h5py
f = h5py.File(sys.argv[1])
rs = [f["requests"][k] for k in sorted(f["requests"])]
ranks = f["ranks"][()]
late = ranks["late_graph_captures"].tolist() if "late_graph_captures" in ranks.dtype.names else "-"
print(sys.argv[2], "| TTFT ms", [round(float(r.attrs["ttft_s"]) * 1e3, 1) for r in rs],
      "| tok/s", [round(float(r.attrs["tokens_per_s"]), 1) for r in rs],
      "| prompt tokens", [len(r["prompt_ids"]) for r in rs], "| late captures", late,
      "|", json.loads(f.attrs["env_json"]).get("graphs"))
PY
}
for tag in ${OLD:+old} new; do
  if [[ $tag == old ]]; then cd "$OLD"; else cd "$ROOT"; fi   # `python3 -m` imports from here
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/install-$tag.log" 2>&1 \
    || { tail -5 "$OUT/install-$tag.log"; exit 1; }
  run $tag ar 1
  run $tag sync 1
  MPS=1 mps_start 2 1 > /dev/null
  run $tag async 2
  mps_stop > /dev/null
done
