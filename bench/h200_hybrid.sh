#!/bin/bash
# Rounds 5 and 6 on one H200 (issue 26): the 7.8B hybrid bench shape, each step a fresh process with a
# fresh kernel cache (a first launch on a bare host). Writes JSON and logs under $OUT. Steps 1 and 2
# take up to 7 minutes each: run them in separate device calls (`STEPS=1`, `STEPS=2`, `STEPS=3`, `STEPS=4`).
#   bash bench/h200_hybrid.sh            (fla 0.6.0 importable; $OUT set)
set -o pipefail
common="--shape hybrid --skip-naive --skip-shm --skip-disk-probe --fla-conv --bucket-rows --pads 64 --warm --track-tuning"
run() {   # name, cache folder, args...
  name=$1; cache=$2; shift 2
  rm -rf "$cache"
  TRITON_CACHE_DIR=$cache/triton TORCHINDUCTOR_CACHE_DIR=$cache/inductor TORCHINDUCTOR_FX_GRAPH_CACHE=1 \
    PYTHONUNBUFFERED=1 timeout "${LIMIT:-300}" python3 bench/extract.py $common --json "$OUT/$name.json" "$@" 2>&1 \
    | grep -v Warning | tail -25 | tee "$OUT/$name.log"
}
# 1. the worker's new hybrid path: regions compiled, warm-up with brief autotuning; pass 1 = a
#    shard's first pass (cold), pass 2 = steady state
[[ ${STEPS:-123} == *1* ]] && LIMIT=420 run regions /tmp/c1 --compile regions --quick-tuning --skip-warmup-pass --passes 2 --samples 1500
# 2. the old path (eager, Triton's default autotuning), same machine: the baseline for both
[[ ${STEPS:-123} == *2* ]] && LIMIT=420 run eager /tmp/c2 --compile off --skip-warmup-pass --passes 2 --samples 1500
# 3. where the GPU time goes with the regions compiled (cache of step 1)
[[ ${STEPS:-123} == *3* ]] && TRITON_CACHE_DIR=/tmp/c1/triton TORCHINDUCTOR_CACHE_DIR=/tmp/c1/inductor PYTHONUNBUFFERED=1 timeout 200 \
  python3 bench/extract.py --shape hybrid --skip-naive --fla-conv --compile regions --profile 3 \
  --json "$OUT/profile.json" 2>&1 | tail -3
# 4. round 6: the worker's tuning (once per kernel at the run's main shape, other sizes reused,
#    widths x16, no row buckets), regions compiled; pass 1 = a shard's first pass after the load
[[ ${STEPS:-123} == *4* ]] && rm -rf /tmp/c7 && TRITON_CACHE_DIR=/tmp/c7/triton TORCHINDUCTOR_CACHE_DIR=/tmp/c7/inductor \
  TORCHINDUCTOR_FX_GRAPH_CACHE=1 TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1 timeout "${LIMIT:-300}" \
  python3 bench/extract.py --shape hybrid --skip-naive --skip-shm --skip-disk-probe --fla-conv --compile regions \
  --pads 16 --worker-tuning --track-tuning --skip-warmup-pass --passes 2 --samples 1500 --json "$OUT/hybrid7b.json" 2>&1 \
  | grep -v Warning | tail -25 | tee "$OUT/hybrid7b.log"
