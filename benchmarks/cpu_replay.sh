#!/usr/bin/env bash
# Speculation's speed-up at replayed acceptance on the CPU: random packed 4-bit weights at the
# shapes of the Qwen2.5-Coder 1.5B target and 0.5B draft (their GGUF files give the shapes), the
# target's choices replayed from the real pair's acceptance model; ar, sync and async (2 ranks)
# with the tree of the recorded run (8 nodes, 4 expansions of 4 leaves in sync); the first
# PROMPTS (default 4) Spec-Bench prompts of swiftspec_mpi/data/spec_bench_13.jsonl, N (default
# 48) new tokens each.
#   bash benchmarks/cpu_replay.sh [OUT]      (needs `swiftspec models prepare default --gguf-only`)
# Summary: OUT/replay.md (benchmarks/replay_summary.py).
set -u
OUT=${1:-/tmp/cpu_replay}; mkdir -p "$OUT"
CACHE=${SWIFTSPEC_CACHE:-.cache/models}
T="$CACHE/gguf/qwen2.5-coder-1.5b.gguf"; D="$CACHE/gguf/qwen2.5-coder-0.5b.gguf"
MODEL=${MODEL:-benchmarks/acceptance/qwen25coder-0.5b-1.5b.json}
N=${N:-48}
head -n "${PROMPTS:-4}" swiftspec_mpi/data/spec_bench_13.jsonl > "$OUT/prompts.jsonl"   # the first categories
COMMON=(--load-format dummy --quant int4 --target "$T" --draft "$D" --prompts "$OUT/prompts.jsonl"
        --chat --max-new-tokens "$N" --ignore-eos --quiet --overwrite --peer-timeout 300)
TREE=(--verify-size 8 --tree-width 4)
timeout 1200 swiftspec run "${COMMON[@]}" --mode ar --out "$OUT/cpu-ar.h5" > "$OUT/cpu-ar.log" 2>&1 || tail -3 "$OUT/cpu-ar.log"
timeout 1200 swiftspec run "${COMMON[@]}" "${TREE[@]}" --expansions 4 --mode sync --accept-from "$MODEL" \
  --out "$OUT/cpu-sync.h5" > "$OUT/cpu-sync.log" 2>&1 || tail -3 "$OUT/cpu-sync.log"
timeout 1200 mpiexec -n 2 swiftspec run "${COMMON[@]}" "${TREE[@]}" --mode async --accept-from "$MODEL" \
  --out "$OUT/cpu-async.h5" > "$OUT/cpu-async.log" 2>&1 || tail -3 "$OUT/cpu-async.log"
python3 benchmarks/replay_summary.py "$OUT"/cpu-*.h5 --json "$OUT/replay.json" | tee "$OUT/replay.md"
