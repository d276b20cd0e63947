"""A user's per-GPU job that takes its rows, as a [job] command with {start}/{end} runs it.

    python rows_job.py OUT START END SHARD [--sleep S] [--slow SHARD=FACTOR ...] [--crash SHARD ...]
                       [--gate-from ROW] [--ungated SHARD ...] [--fixed ROWS:NUM_SHARDS]

Each row i of [START, END) takes S seconds (times FACTOR on a slow shard), then is written as one
line "i SHARD TIME" appended to OUT/rows.txt (O_APPEND: one line per write, whatever runs beside
it), so a test reads which rows were done, how often, by whom and when; a progress line after each
row and "ALL DONE" at the end. A crashing shard prints an ERROR line and exits 1 before its first
row, until OUT/heal-SHARD exists. While OUT/gate exists, rows from ROW on wait (except on an
ungated shard).
"""

import argparse
import os
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("start", type=int)
ap.add_argument("end", type=int)
ap.add_argument("shard", type=int)
ap.add_argument("--sleep", type=float, default=0.0)
ap.add_argument("--slow", action="append", default=[])
ap.add_argument("--crash", type=int, action="append", default=[])
ap.add_argument("--gate-from", type=int, default=None)
ap.add_argument("--ungated", type=int, action="append", default=[])
ap.add_argument("--fixed", default=None, help="ROWS:NUM_SHARDS: the shard's own fixed range instead of START END")
args = ap.parse_args()
if args.fixed:                             # a job that does not take its rows (bench/job_leases.py's "fixed")
    rows, shards = map(int, args.fixed.split(":"))
    args.start, args.end = rows * args.shard // shards, rows * (args.shard + 1) // shards
if args.shard in args.crash and not os.path.exists(os.path.join(args.out, f"heal-{args.shard}")):
    print("ERROR: this GPU fell off the bus", flush=True)
    sys.exit(1)
factor = dict((int(k), float(v)) for k, v in (s.split("=") for s in args.slow)).get(args.shard, 1.0)
os.makedirs(args.out, exist_ok=True)
fd = os.open(os.path.join(args.out, "rows.txt"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
n = args.end - args.start
gate = os.path.join(args.out, "gate")
for k, i in enumerate(range(args.start, args.end), 1):
    while args.gate_from is not None and i >= args.gate_from and args.shard not in args.ungated \
            and os.path.exists(gate):
        time.sleep(0.05)
    time.sleep(args.sleep * factor)
    os.write(fd, f"{i} {args.shard} {time.time():.3f}\n".encode())
    print(f"processed {k}/{n}", flush=True)
print("ALL DONE", flush=True)
