#!/usr/bin/env bash
# Draft pacing on one shared GPU (MPS), on the H200 machine: bash benchmarks/gpu_pacing.sh
# bf16 Llama-3-8B target with a draft of its first 4 layers, and the 4-bit 70B target with the 1B
# draft: sync; async rate and fresh as they run by default on a shared GPU (the draft paced to
# the profile's d); rate with --expansions 1000 (no pause in practice); rate and fresh with
# d = 2. One prompt, 128 tokens, --ignore-eos, random weights. Summaries in $OUT/pacing.txt.
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
source "$(dirname "${BASH_SOURCE[0]}")/../jobs/mps.sh"
T0=$SECONDS
P="Write a quicksort in Python with comments explaining each step."
run() {  # name, ranks, args
  local name=$1 n=$2; shift 2
  timeout 100 $MPI -n $n $SW run --load-format dummy --device cuda --dtype bfloat16 --prompt "$P" \
    --max-new-tokens 128 --ignore-eos --out /tmp/p/$name.h5 --overwrite --quiet "$@" > /tmp/p/$name.log 2>&1 || tail -3 /tmp/p/$name.log
  $SW analyze /tmp/p/$name.h5 > /tmp/p/$name.txt 2>&1
  echo "-- $name ($((SECONDS - T0)) s)"; grep -E "^tokens/s  |verify: verify|draft: expand|idle" /tmp/p/$name.txt | head -6
  python3 -c "import h5py, json, sys; print('draft_pace', json.loads(h5py.File(sys.argv[1])['/'].attrs['env_json']).get('draft_pace'))" /tmp/p/$name.h5
}
mkdir -p /tmp/p
for cfg in "8b:--target llama-3-8b --draft-layers 4" "70b:--target llama-3-70b --quant int4 --draft llama-3.2-1b"; do
  tag=${cfg%%:*}; args=${cfg#*:}
  run $tag-sync 1 --mode sync $args
  MPS=1 mps_start 2 1
  run $tag-rate 2 --mode async --async-policy rate $args
  run $tag-fresh 2 --mode async --async-policy fresh $args
  run $tag-rate-unpaced 2 --mode async --async-policy rate --expansions 1000 $args
  run $tag-rate-d2 2 --mode async --async-policy rate --expansions 2 $args
  run $tag-fresh-d2 2 --mode async --async-policy fresh --expansions 2 $args
  mps_stop
done 2>&1 | tee $OUT/pacing.txt
echo "all done at $((SECONDS - T0)) s"
