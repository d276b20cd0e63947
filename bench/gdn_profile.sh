#!/bin/bash
# The 27B hybrid's forward profiled three ways on one GPU, one process each (issue 38, round 12):
#   regions  the worker's path before: the non-fla modules compiled (worker.model.compile_regions)
#   split    the same, with q, k and v projected and convolved apart (worker.gdn): no copies for fla
#   layers   split, and whole decoder layers compiled around the linear-attention blocks
#            (worker.model.compile_hybrid_layers): the residual adds fused with the norms
# Each: fla's conv, the worker's tuning on one block at the run's shapes, then 3 forwards of
# 16 x 1,024 random ids timed unprofiled and under the profiler (bench/extract.py --profile).
#   OUT=/tmp/out MODES="regions split layers" bash bench/gdn_profile.sh
set -u
OUT=${OUT:-/tmp/gdn-profile}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/machine.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$OUT/machine.txt"
for mode in ${MODES:-regions split layers}; do
  case $mode in
    regions) extra="--compile regions" ;;
    split) extra="--compile regions --split-projections" ;;
    layers) extra="--compile layers --split-projections" ;;
  esac
  timeout "${STEP_TIMEOUT:-240}" python3 bench/extract.py --shape hybrid27 --skip-naive --skip-shm --skip-disk-probe \
    --fla-conv --worker-tuning --samples 400 --profile 3 $extra --json "$OUT/profile-$mode.json" > "$OUT/profile-$mode.log" 2>&1
  echo "$mode: exit $?"
  python3 - "$OUT/profile-$mode.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"  no result: {e}")
p = d["profile"]
copies = sum(k["share"] for k in p["top"] if "direct_copy" in k["kernel"])
adds = sum(k["share"] for k in p["top"] if "CUDAFunctor_add<c10::BFloat16>" in k["kernel"])
mfu = 2 * d["nonembedding_params"] * p["tokens"] / p["forwards"] / (p["wall_ms_per_forward"] / 1e3) / (d["peak_tflops"] * 1e12)
print(f"  {d['gpu']}: {mfu:.1%} MFU (forward), wall {p['wall_ms_per_forward']} ms, gpu {p['gpu_ms_per_forward']} ms, "
      f"share {p['share']}, copies {copies:.3f}, bf16 adds {adds:.3f}, compile {d.get('compile_s')} s, "
      f"split {d.get('split_projections')}, ref err {d.get('ref_rel_err')} / {d.get('ref_rel_err_regions')}")
PY
done
