#!/bin/bash
# End to end through fleet and the worker, on rows that pad as a real shard's do (issue 38,
# round 13). Each RUN is one step, its output under $OUT/<run>:
#   h27         bench/gpu_fleet.py --shape hybrid27, 1,300 rows sorted alone (the issue's figure)
#   h27-window  the same, the rows of every 15th batch of one 20,000-row sort window (bench/window.py)
#   h27-own     h27-window with the linear-attention layers' own forward (FLEET_SPLIT_PROJECTIONS=0)
#   h27-pad8    h27-window with batch widths padded to 8, not 16
#   h27-pass    bench/extract.py --shape hybrid27, the worker's path (fla, its conv, the regions compiled,
#               q/k/v split, its tuning): one 16 x 1,024 forward alone (--profile 3), then two passes
#               of run_extraction over the rows of every 29th batch of a 20,000-row window (636 rows),
#               and a third under the profiler (--profile-pass)
#   h27-pass-own  the same without the split (the linear-attention layers' own forward)
#   h27-pass-fused  h27-pass with the MLPs' gate, up and SiLU·mul as one Triton kernel (bench/swiglu.py, round 14)
#   dense       bench/extract.py --shape dense, compiled, local disk, 1,200 rows sorted alone
#   dense-window  the same over a window's batches
#   dense-fused, dense-window-fused  the same two with that kernel
#   OUT=/tmp/out RUNS="h27-window h27" bash bench/e2e_window.sh
set -u
OUT=${OUT:-/tmp/e2e-window}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/machine.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$OUT/machine.txt"
for run in ${RUNS:-h27-window h27}; do
  start=$(date +%s)
  h27="python3 bench/gpu_fleet.py --shape hybrid27 --once --samples 1300 --out $OUT/$run"
  pass="python3 bench/extract.py --shape hybrid27 --skip-naive --skip-shm --skip-disk-probe --fla-conv --compile regions
        --worker-tuning --samples 700 --window 20000 --pads 16 --profile 3 --profile-pass --skip-warmup-pass --passes 2"
  dense="python3 bench/extract.py --shape dense --skip-naive --skip-shm --compile on --skip-disk-probe --json $OUT/$run.json"
  case $run in
    h27) cmd="$h27" ;;
    h27-window) cmd="$h27 --window 20000" ;;
    h27-own) cmd="env FLEET_SPLIT_PROJECTIONS=0 $h27 --window 20000" ;;
    h27-pad8) cmd="$h27 --window 20000 --worker-args=--pad-multiple=8" ;;
    h27-pass) cmd="$pass --split-projections --json $OUT/$run.json" ;;
    h27-pass-own) cmd="$pass --json $OUT/$run.json" ;;
    h27-pass-fused) cmd="$pass --split-projections --fused-swiglu --json $OUT/$run.json" ;;
    dense) cmd="$dense" ;;
    dense-window) cmd="$dense --window 20000" ;;
    dense-fused) cmd="$dense --fused-swiglu" ;;
    dense-window-fused) cmd="$dense --window 20000 --fused-swiglu" ;;
    *) echo "unknown run $run"; continue ;;
  esac
  timeout "${STEP_TIMEOUT:-300}" $cmd > "$OUT/$run.log" 2>&1
  echo "$run: exit $? in $(( $(date +%s) - start )) s"
  python3 - "$OUT" "$run" <<'PY'
import json, os, sys
out, run = sys.argv[1:]
fleet = run.startswith("h27") and "pass" not in run
path = f"{out}/{run}/result.json" if fleet else f"{out}/{run}.json"
try:
    d = json.load(open(path))
except Exception as e:
    sys.exit(f"  no result: {e}")
if fleet:
    f = d.get("first", {})
    for g in f.get("per_gpu", []):
        print(f"  {d['gpu_name']} peak {d['peak_tflops']}: load {g['load_s']} s, first minute {g['mfu_first_minute']:.1%}, "
              f"steady {g['steady_tokens_per_s']} tokens/s = {g['mfu_steady']:.1%}, data {d.get('data')}, verify {f.get('verify_rc')}")
        print(f"  path: {g['path']}")
else:
    peak, params = d["peak_tflops"] * 1e12, d["nonembedding_params"]
    if "profile" in d:
        p = d["profile"]
        print(f"  forward alone {p['shape']}: {p['wall_ms_per_forward']} ms = "
              f"{2 * params * p['tokens'] / p['forwards'] / (p['wall_ms_per_forward'] / 1e3) / peak:.1%}, share {p['share']}")
    for name, r in d.items():
        if isinstance(r, dict) and "tokens_per_s" in r:
            print(f"  {d['gpu']} peak {d['peak_tflops']}: {name} {r['tokens_per_s']} tokens/s = {r['mfu']:.1%}, "
                  f"writer wait {r.get('writer_wait_s')} s of {r.get('seconds', 0):.1f} s, rows {d.get('rows')}")
        elif name.startswith("profiled_"):
            print(f"  {name}: {r['tokens'] / r['seconds']:.0f} tokens/s = {2 * params * r['tokens'] / r['seconds'] / peak:.1%}, "
                  f"GPU busy {r['gpu_busy_share']:.2%}, share {r['share']}")
PY
done
