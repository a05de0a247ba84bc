#!/usr/bin/env bash
# The CPU figures of docs/benchmarks.md, on the real Qwen2.5-Coder 0.5B -> 1.5B pair, 2 cores:
#   1. model decode latency, ours vs HF transformers (bench_model_cpu.py, 1 and 2 threads)
#   2. our ar / sync / async vs HF greedy and HF assisted, 4 code/prose prompts x 96 tokens,
#      bfloat16 and float32 (same prompts, dtype, cores for every system)
#   3. ar / sync / async over 32 Spec-Bench prompts (benchmarks/prompts_specbench32.jsonl: the
#      13 categories round-robin) x 128 tokens, bfloat16
# Usage: bash benchmarks/cpu_bench.sh [OUT_DIR] [STEPS]   (make venv models first; STEPS e.g. "1 2")
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/cpu-bench}
STEPS=${2:-"1 2 3"}
SW=.venv/bin/swiftspec
mkdir -p "$OUT"
for step in $STEPS; do
  case $step in
  1) for th in 1 2; do
       .venv/bin/python benchmarks/bench_model_cpu.py --threads $th --json "$OUT/model-t$th.json" \
         > "$OUT/model-t$th.md" 2>&1 || true
     done ;;
  2) for dt in bfloat16 float32; do
       $SW bench --prompts benchmarks/prompts_cpu4.jsonl --per-category 2 --max-new-tokens 96 --chat \
         --dtype "$dt" --np 2 --systems ar,sync,async,hf-greedy,hf-assisted \
         --out-dir "$OUT/hf-$dt" || true
     done ;;
  3) $SW bench --prompts benchmarks/prompts_specbench32.jsonl --per-category 99 --max-new-tokens 128 \
       --chat --dtype bfloat16 --np 2 --systems ar,sync,async --out-dir "$OUT/specbench32-bf16" || true ;;
  esac
done
