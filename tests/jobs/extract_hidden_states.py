"""The seed user's own per-GPU script, as people write it: a contiguous shard of the rows, one
`hs_<row>.safetensors` per row, `processed i/N` per row, and `extract-only mode` at the end.
With --fail-marker present, shard 1 hits a CUDA error half-way and exits 1."""

import argparse
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--shard", type=int, required=True)
ap.add_argument("--num-shards", type=int, required=True)
ap.add_argument("--out", required=True)
ap.add_argument("--rows", type=int, default=40)
ap.add_argument("--fail-marker", default=None)
args = ap.parse_args()
per = -(-args.rows // args.num_shards)
rows = range(args.shard * per, min(args.rows, (args.shard + 1) * per))
os.makedirs(args.out, exist_ok=True)
print(f"loading model for shard {args.shard}", flush=True)
for n, row in enumerate(rows, 1):
    path = os.path.join(args.out, f"hs_{row}.safetensors")
    if not os.path.exists(path):
        with open(path + ".tmp", "wb") as f:
            f.write(os.urandom(256))
        os.replace(path + ".tmp", path)
        time.sleep(0.02)
    if args.fail_marker and os.path.exists(args.fail_marker) and args.shard == 1 and n == len(rows) // 2:
        print("ERROR: CUDA error: an illegal memory access was encountered", flush=True)
        sys.exit(1)
    print(f"processed {n}/{len(rows)}", flush=True)
print(f"shard {args.shard}: all rows written, running in extract-only mode", flush=True)
