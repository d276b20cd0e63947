"""The shard ETA replayed on recorded runs (issue 25): at every fraction of a shard's extraction,
the ETA fleet showed (fleet/figures.py's `pace_eta`, from the record up to that moment) against
the seconds really left, and the same for the pace it replaced (time per token over the last
2 minutes of completed batches, the record's cost fields ignored).

    python bench/eta_replay.py tests/data/runs/*.jsonl [--every 5] [--json out.json]

A shard's "run" is its extraction, from when its first batch began (`batches_from`; for an
older record without it, `loaded`) to `done`: before the first batch the shard is LOADING (the
model, reading its rows) and has no ETA by design; the run ends when its last row is written
(the worker's finishing after that, before `done`, is not counted by the ETA).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fleet.figures import pace, pace_eta  # noqa: E402
from fleet.record import fold  # noqa: E402
from worker import protocol  # noqa: E402


def extraction(events: list[protocol.Record]) -> tuple[float, float]:
    """(start, end) of the record's last attempt's extraction: its first batch (or `loaded`), its
    last row written (what comes after, before `done`, is finishing that the ETA does not count)."""
    end = next(e for e in reversed(events) if isinstance(e, protocol.Done))
    began = next((e.batches_from for e in events if isinstance(e, protocol.Progress) and e.batches_from), None)
    start = began or next(e.t for e in reversed(events) if isinstance(e, protocol.Loaded) and e.t <= end.t)
    written = next(e.t for e in events if isinstance(e, protocol.Progress) and e.tokens == end.tokens)
    return start, written


def replay(events: list[protocol.Record], fraction: float) -> tuple[float, float | None, float | None]:
    """(seconds left, ETA now, ETA of the pace it replaced) at `fraction` of the extraction."""
    start, end = extraction(events)
    t = start + (end - start) * fraction
    record = fold([e for e in events if e.t <= t])
    p = pace(record, t)
    before = pace_eta(record, dataclasses.replace(p, cost=None)) if p is not None else None
    return end - t, pace_eta(record, p), before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--every", type=int, default=10, help="percent between checkpoints")
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {}
    for path in args.runs:
        events = protocol.read_events(path)
        try:
            start, end = extraction(events)
        except StopIteration:           # a run that never finished (a fatal shard) has no end to replay
            print(f"{os.path.basename(path)}: not replayed (no done)")
            continue
        rows = []
        print(f"{os.path.basename(path)}: extraction {end - start:.1f} s")
        print(f"  {'at':>4} {'left':>7} {'ETA':>7} {'err':>6} {'before':>7} {'err':>6}")
        for pct in range(args.every, 100, args.every):
            left, now, before = replay(events, pct / 100)
            err = None if now is None else (now - left) / left
            berr = None if before is None else (before - left) / left
            rows.append({"percent": pct, "left_s": round(left, 1), "eta_s": now, "error": err,
                         "before_s": before, "before_error": berr})
            fmt = lambda x: "—" if x is None else f"{x:.1f}"        # noqa: E731
            pc = lambda x: "—" if x is None else f"{x:+.0%}"         # noqa: E731
            print(f"  {pct:>3}% {left:>7.1f} {fmt(now):>7} {pc(err):>6} {fmt(before):>7} {pc(berr):>6}")
        out[os.path.basename(path)] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
