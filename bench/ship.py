"""Shipping throughput against the host's own disk write rate (issue 34).

1. The disk: `--files` sample-sized files of `--mb` MB written as the writer writes them (temp
   name, fsync, rename), timed.
2. Shipping: the same files moved by the worker's Shipper (rclone move, checksums compared, then
   deleted here) into a real S3-compatible store on 127.0.0.1 (`rclone serve s3` over a folder
   of the same disk), timed from the first hand-over to the last file gone, with the local
   high-water mark under `--keep` bytes sampled by the Shipper's own events.

Both land on the same disk here, so the store's write competes with the source's read: a lower
bound on what a host with a separate uplink gets. Prints one JSON object.

    python bench/ship.py [--files 200] [--mb 20] [--keep 400MB]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.s3_store import S3Store                  # noqa: E402
from worker.files import write_atomic               # noqa: E402
from worker.ship import Shipper, destination        # noqa: E402
from worker.text import bytes_text, parse_bytes     # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--mb", type=float, default=20)
    ap.add_argument("--keep", type=parse_bytes, default=parse_bytes("400MB"))
    args = ap.parse_args()
    size = int(args.mb * 1e6)
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as tmp:
        out = os.path.join(tmp, "out")
        os.makedirs(os.path.join(out, "manifest"))
        blob = os.urandom(size)
        t0 = time.perf_counter()
        for i in range(args.files):
            write_atomic(os.path.join(out, f"hs_{i}.safetensors"), blob)
        disk_s = time.perf_counter() - t0
        for i in range(args.files):               # back out: the shipping pass writes them again
            os.unlink(os.path.join(out, f"hs_{i}.safetensors"))

        store = S3Store(os.path.join(tmp, "store")).start()
        os.environ.update(store.env())
        events = []
        shipper = Shipper(out, destination("s3://bucket/bench"), 0,
                          lambda i: os.path.join(out, f"hs_{i}.safetensors"), args.keep, events.append).resume([])
        t0 = time.perf_counter()
        for i in range(args.files):               # the writer's side: room, write, record
            shipper.room(size)
            write_atomic(os.path.join(out, f"hs_{i}.safetensors"), blob)
            shipper.add([{"index": i, "bytes": size}])
        shipper.finish()
        ship_s = time.perf_counter() - t0
        store.kill()
        landed = sum(1 for n in os.listdir(store.bucket_dir("bench")) if n.startswith("hs_"))
    total = size * args.files
    print(json.dumps({
        "files": args.files, "file_bytes": size, "total": bytes_text(total),
        "disk_write_MBps": round(total / disk_s / 1e6, 1),
        "write_and_ship_MBps": round(total / ship_s / 1e6, 1),
        "keep_local": bytes_text(args.keep),
        "local_high_water": bytes_text(max(e.local_bytes for e in events)),
        "waits": sum(1 for e in events if e.waiting and e.waiting.startswith("waiting")),
        "landed": landed, "cpus": os.cpu_count(),
    }))


if __name__ == "__main__":
    main()
