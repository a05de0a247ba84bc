#!/usr/bin/env bash
# The CPU figures of docs/benchmarks.md, on the real Qwen2.5-Coder 0.5B -> 1.5B pair, 2 cores:
#   1. our ar / sync / async vs HF greedy and HF assisted, 4 code/prose prompts x 96 tokens,
#      float32 and bfloat16 (same prompts, dtype, cores for every system)
#   2. ar / sync / async over Spec-Bench prompts x 128 tokens (bf16)
# Usage: bash benchmarks/cpu_bench.sh [OUT_DIR]     (make venv models first)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/cpu-bench}
SW=.venv/bin/swiftspec
mkdir -p "$OUT"
for dt in bfloat16 float32; do
  $SW bench --prompts benchmarks/prompts_cpu4.jsonl --per-category 2 --max-new-tokens 96 --chat \
    --dtype "$dt" --np 2 --systems ar,sync,async,hf-greedy,hf-assisted \
    --out-dir "$OUT/hf-$dt" || true
done
$SW bench --per-category "${PER_CATEGORY:-3}" --max-new-tokens 128 --chat --dtype bfloat16 --np 2 \
  --systems ar,sync,async --out-dir "$OUT/specbench-bf16" || true
