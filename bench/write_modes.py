"""How fast a host's disk takes the writer's files, by the way they are written (issue 38: "the disk
never the bound").

Writes `--gb` of `--mb`-sized files into `--disk` in each mode, `--threads` at once, and reports
GB/s with the time until every byte is durable:

- `fsync-each`: write, fsync, next file (the worker's writer today; worker.probe.timed_writes);
- `sync-once`: write every file, then one sync of the file system (durable only at the end);
- `direct`: O_DIRECT from an aligned buffer, fsync each (no page cache);
- `fsync-each-16`: the first mode with twice the threads.

    python bench/write_modes.py --disk /tmp --gb 16 --json $OUT/write-modes.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from worker.probe import timed_writes  # noqa: E402


def _files(where: str, block, count: int, threads: int, flags: int, fsync: bool) -> None:
    def one(i: int) -> None:
        fd = os.open(os.path.join(where, f"{i}.bin"), os.O_WRONLY | os.O_CREAT | flags, 0o644)
        try:
            os.write(fd, block)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(count)))


def timed(disk: str, mode: str, file_bytes: int, count: int, threads: int) -> float:
    if mode.startswith("fsync-each"):
        return timed_writes(disk, file_bytes, count, threads)
    where = tempfile.mkdtemp(dir=disk, prefix=".fleet-modes-")
    try:
        if mode == "direct":
            block = mmap.mmap(-1, file_bytes)            # page-aligned, as O_DIRECT wants
            block.write(os.urandom(file_bytes))
            t0 = time.perf_counter()
            _files(where, block, count, threads, os.O_DIRECT, fsync=True)
        else:
            block = os.urandom(file_bytes)
            t0 = time.perf_counter()
            _files(where, block, count, threads, 0, fsync=False)
            os.sync()
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(where, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--disk", default="/tmp")
    p.add_argument("--gb", type=float, default=16.0)
    p.add_argument("--mb", type=int, default=20, help="bytes of one file: a row of ~1,200 tokens x 4 layers x 4,096")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--modes", default="fsync-each,sync-once,direct,fsync-each-16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    file_bytes = args.mb << 20
    count = max(1, int(args.gb * 1e9 / file_bytes))
    out = {"disk": args.disk, "file_bytes": file_bytes, "files": count, "runs": []}
    for mode in args.modes.split(","):
        threads = 16 if mode.endswith("-16") else args.threads
        os.sync()
        try:
            s = timed(args.disk, mode, file_bytes, count, threads)
            run = {"mode": mode, "threads": threads, "seconds": round(s, 2),
                   "gb_per_s": round(file_bytes * count / s / 1e9, 3)}
        except OSError as e:
            run = {"mode": mode, "threads": threads, "error": str(e)}
        out["runs"].append(run)
        print(json.dumps(run), flush=True)
    if args.json:
        json.dump(out, open(args.json, "w"), indent=2)


if __name__ == "__main__":
    main()
