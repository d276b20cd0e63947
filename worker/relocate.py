"""Rows moved between hosts, on the host: `python -m worker.relocate adopt|revoke ...` (issue 33).

The supervisor (fleet/relocate.py) decides; this carries it out in the host's pool ledger
(worker/leases.py, through its one door `open_ledger`) and says so in the shards' records:

    adopt   the rows of a lost host become free rows of this host's pool: its running shards take
            them before stealing from each other, and each of its shards that ran dry and left
            (the ledger's `idle`) is reopened so that the supervisor launches it again; a
            `relocated` record (side "in") in the pool's first shard says where they came from
    revoke  on the lost host, back: those rows are gone from its pool (a holder stops them at its
            next tick) and a `relocated` record (side "out") in each of its shards says where
            they went: the supervisor knows it need not tell this host again
    pending the rows of this host's pool not yet done (held or free, less every row a manifest
            records): what a host whose every shard gave up (FATAL) or was stopped gives away
            (`why` idle: adopted by the others, then revoked here, as a lost host's are)

Both are safe to repeat (a command retried after a timeout): rows already adopted are not added
twice, rows already gone stay gone. One JSON object on stdout (protocol.Status). Standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import protocol
from .files import manifest_records
from .leases import ledger_path, merge, open_ledger, subtract
from .ranges import shard_range, to_runs
from .text import parse_runs_text


def pool_ranges(out_dir: str, num_shards: int, pool: list[int], num_rows: int | None = None
                ) -> dict[int, tuple[int, int]]:
    """The planned rows of the pool's shards, from the run's rows (a [job]'s `rows`), else the
    dataset's rows in the folder's meta.json. Raises FileNotFoundError when no shard has written
    there yet."""
    if num_rows is None:
        with open(os.path.join(out_dir, protocol.META_FILE)) as f:
            num_rows = int(json.load(f)["num_samples"])
    return {k: shard_range(num_rows, num_shards, k) for k in pool}


def dataset_rows(out_dir: str, num_rows: int | None) -> int | None:
    """The run's rows (given, or meta.json's), which every entry of a ledger lies within."""
    if num_rows is not None:
        return num_rows
    try:
        with open(os.path.join(out_dir, protocol.META_FILE)) as f:
            return int(json.load(f)["num_samples"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def adopt(out_dir: str, run_dir: str, num_shards: int, pool: list[int], runs: list[tuple[int, int]],
          from_host: str, to_host: str, redone: int, num_rows: int | None = None,
          why: str = "lost") -> protocol.Status:
    ranges = pool_ranges(out_dir, num_shards, pool, num_rows)
    with open_ledger(ledger_path(out_dir, ranges), ranges, dataset_rows(out_dir, num_rows)) as ledger:
        new = ledger.adopt(runs, from_host)
        added = sum(b - a for a, b in new)
        if added:                               # a shard of the pool that ran dry and left has work again
            for k in ledger.idle:               # (before the move's record: the supervisor counts the
                d = protocol.shard_dir(run_dir, k)   # rows in flight until it reads that record)
                os.makedirs(d, exist_ok=True)
                protocol.append_jsonl(os.path.join(d, protocol.EVENTS_FILE),
                                      protocol.Reopened(samples=added, reason=f"rows of {why} host {from_host}"))
        first = protocol.shard_dir(run_dir, min(pool))
        os.makedirs(first, exist_ok=True)
        for a, b in new:
            protocol.append_jsonl(os.path.join(first, protocol.EVENTS_FILE),
                                  protocol.Relocated(start=a, stop=b, from_host=from_host, to_host=to_host,
                                                     side="in", redone=redone, why=why))
    return protocol.Status("adopted" if added else "already", f"{added} row(s)")


def revoke(out_dir: str, run_dir: str, num_shards: int, pool: list[int], runs: list[tuple[int, int]],
           from_host: str, to_host: str, num_rows: int | None = None, why: str = "lost") -> protocol.Status:
    try:
        ranges = pool_ranges(out_dir, num_shards, pool, num_rows)
    except (OSError, ValueError, KeyError):      # nothing was ever written here: nothing to take back
        ranges = None
    lost: list[int] = []
    if ranges is not None:
        with open_ledger(ledger_path(out_dir, ranges), ranges, dataset_rows(out_dir, num_rows)) as ledger:
            lost = ledger.revoke(runs, to_host)
    for k in pool:
        d = protocol.shard_dir(run_dir, k)
        os.makedirs(d, exist_ok=True)
        for a, b in runs:
            protocol.append_jsonl(os.path.join(d, protocol.EVENTS_FILE),
                                  protocol.Relocated(start=a, stop=b, from_host=from_host, to_host=to_host,
                                                     side="out", why=why))
    return protocol.Status("revoked", f"{len(lost)} lease(s) stopped")


def pending(out_dir: str, num_shards: int, pool: list[int], num_rows: int | None = None) -> protocol.Unfinished:
    """The pool's rows not yet done: its ledger's held and free rows (its planned rows where no
    ledger was ever written), less every row a manifest in the folder records (written or
    skipped: a dead holder's finished part of its lease). Read under the ledger's lock; changes
    nothing."""
    ranges = pool_ranges(out_dir, num_shards, pool, num_rows)
    with open_ledger(ledger_path(out_dir, ranges), ranges, dataset_rows(out_dir, num_rows)) as ledger:
        rows = merge([(l.start, l.stop) for l in ledger.held.values()] + [(a, b) for a, b, _ in ledger.free])
    finished = to_runs(sorted({rec["index"] for rec in manifest_records(out_dir)}))
    return protocol.Unfinished(runs=[list(r) for r in subtract(rows, [(a, b) for a, b in finished])])


WHY = ("lost", "idle", "removed")    # why rows move: the host is unreachable, has no GPU left that
                                     # can go on, or was taken out of fleet.toml


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.relocate", description=__doc__.split("\n\n")[0])
    ap.add_argument("cmd", choices=("adopt", "revoke", "pending"))
    ap.add_argument("--out", required=True, help="the host's output folder (its pool ledger is in .fleet/); "
                    "for a [job] taking its rows, the run's state folder")
    ap.add_argument("--num-rows", type=int, default=None,
                    help="the run's rows (a [job]'s `rows`); default: the dataset's, from <out>/meta.json")
    ap.add_argument("--run-dir", required=True, help="the run's state folder on the host (shards/<k>/)")
    ap.add_argument("--num-shards", type=int, required=True)
    ap.add_argument("--pool", required=True, help="this host's shards, comma-separated")
    ap.add_argument("--rows", default="", help="the rows moved, as people and Slurm write them: 0-99,250-299")
    ap.add_argument("--from-host", default="", help="the host that was lost")
    ap.add_argument("--to-host", default="", help="the host the rows go to")
    ap.add_argument("--redone", type=int, default=0, help="rows the lost host had reported finished")
    ap.add_argument("--why", choices=WHY, default="lost", help="why the rows move")
    args = ap.parse_args(argv)
    pool = sorted(int(k) for k in args.pool.split(",") if k.strip())
    result: protocol.Unfinished | protocol.Status
    try:
        runs = parse_runs_text(args.rows)
        if args.cmd == "pending":
            result = pending(args.out, args.num_shards, pool, args.num_rows)
        elif args.cmd == "adopt":
            result = adopt(args.out, args.run_dir, args.num_shards, pool, runs, args.from_host, args.to_host,
                           args.redone, args.num_rows, args.why)
        else:
            result = revoke(args.out, args.run_dir, args.num_shards, pool, runs, args.from_host, args.to_host,
                            args.num_rows, args.why)
    except (OSError, ValueError, KeyError) as e:             # (LedgerError is a ValueError: said)
        what = f"{args.cmd} rows {args.rows}" if args.rows else args.cmd
        why = f"{what} in {args.out}: {type(e).__name__}: {e}"
        result = protocol.Unfinished(error=why) if args.cmd == "pending" else protocol.Status("error", why)
    print(result.to_json(), flush=True)          # an error is said in the reply, which the caller reads
    return 0


if __name__ == "__main__":
    sys.exit(main())
