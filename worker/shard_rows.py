"""The rows that count for a shard in its pool (worker/leases.py) and its counts over them: the
leases it held and holds, what its manifests say is done or skipped there, a dead mate's lease taken
over told in that mate's record, the skips a person's launch retries, and whether it skipped too
many to count as done.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter
from typing import Callable

from . import protocol
from .data import shard_range
from .events import EventLog
from .files import retry_skips, retryable
from .launches import LaunchState
from .leases import Lease, Move, tell_taken
from .text import ranges_text
from .writer import Stats, load_finished, remove_stale_temps


def pool_ranges(args: argparse.Namespace, num_rows: int) -> dict[int, tuple[int, int]]:
    """The planned rows of each shard of this shard's pool (--pool; alone: its own)."""
    members = sorted({args.shard_index, *args.pool})
    return {k: shard_range(num_rows, args.num_shards, k) for k in members}


class Holding:
    """This shard's counts while it holds `lease`, as before leases for one range: the finished
    rows (by any launch) of the leases that count for it and of this one, out of their rows; a
    steal takes its rows out of both, and `size` has them sized (the ETA's tokens) again."""

    def __init__(self, out_dir: str, lease: Lease, counted: list[tuple[int, int]], log: EventLog,
                 sizer: Callable[[list[tuple[int, int]]], object] = lambda ranges: None,
                 spill: tuple[str, ...] = ()):
        remove_stale_temps(out_dir, lease.start, lease.stop, spill)    # a dead holder's leftovers too
        self.finished = load_finished(out_dir)
        self.ranges = [*counted, (lease.start, lease.stop)]
        self.stats = resumed_stats(self.finished, self.ranges)
        self.rows = sum(b - a for a, b in self.ranges)
        self.owed = sum(1 for i in range(lease.start, lease.stop) if i not in self.finished)
        self.log, self.sizer = log, sizer

    def total(self) -> int:
        return self.rows

    def size(self) -> None:
        """Have the rows that count for this shard now sized, in the background."""
        self.sizer(list(self.ranges))

    def given_up(self, move: Move) -> None:
        """A steal took rows [move.start, move.stop), none of them read yet."""
        gone = [self.finished[i] for i in range(move.start, move.stop) if i in self.finished]
        with self.stats.lock:
            self.rows -= move.stop - move.start
            self.stats.done -= sum(1 for r in gone if "skipped" not in r)
            self.stats.skipped -= sum(1 for r in gone if "skipped" in r)
        self.ranges[-1] = (self.ranges[-1][0], move.start)
        self.log.emit(protocol.LeaseMoved(start=move.start, stop=move.stop, to_shard=move.target, why="stolen",
                                          rows=move.stop - move.start - len(gone), total=self.rows, holds=True))
        self.size()


def tell_source(args: argparse.Namespace, move: Move, counted: list[tuple[int, int]]) -> None:
    """A dead shard's lease taken over: said in its own record (leases.tell_taken), with the
    counts of the leases that still count for it."""
    if not args.state or os.path.basename(os.path.dirname(os.path.abspath(args.state))) != "shards":
        return
    finished = load_finished(args.out)
    stats = resumed_stats(finished, counted)
    tell_taken(os.path.dirname(os.path.abspath(args.state)), move,
               sum(1 for i in range(move.start, move.stop) if i not in finished),
               sum(b - a for a, b in counted), stats.done, stats.skipped)


def retry_on_a_persons_launch(args: argparse.Namespace, log: EventLog) -> None:
    """A launch a person asked for (r, fleet restart, fleet up on a FATAL shard) retries the rows
    this shard skipped for failures that may pass (out of memory alone, a GPU error): they judged
    the cause gone. The policy's own restarts do not."""
    if not args.state or LaunchState.read(os.path.join(args.state, protocol.EVENTS_FILE)).by != "manual":
        return
    if rows := retry_skips(args.out, args.shard_index):
        log.emit(protocol.WarningEvent(message=f"retrying {len(rows)} row(s) skipped for failures that may "
                                               f"pass ({ranges_text(rows)}): a launch by hand"))


def resumed_stats(finished: dict[int, dict], ranges: list[tuple[int, int]]) -> Stats:
    """The shard's counters over its rows `ranges` as the manifests leave them: a resumed launch,
    or a new lease, counts on from there."""
    stats = Stats()
    in_range = [rec for i, rec in finished.items() if any(a <= i < b for a, b in ranges)]
    stats.done = sum(1 for r in in_range if "skipped" not in r)
    stats.skipped = len(in_range) - stats.done
    stats.tokens = sum(r.get("tokens", 0) for r in in_range)
    stats.sq_tokens = sum(r.get("tokens", 0) ** 2 for r in in_range)
    stats.bytes = sum(r.get("bytes", 0) for r in in_range)
    return stats


def too_many_skipped(out_dir: str, ranges: list[tuple[int, int]], limit: float) -> str | None:
    """Nothing counts as done that did nothing: more than `limit` of the shard's rows (`ranges`)
    skipped fails it, with the count and the commonest reasons."""
    skipped = [r["skipped"] for i, r in load_finished(out_dir).items()
               if "skipped" in r and any(a <= i < b for a, b in ranges)]
    rows = sum(b - a for a, b in ranges)
    if not rows or len(skipped) <= limit * rows:
        return None
    reasons = Counter(re.sub(r"\d{2,}|(?<=\[)\d+(?=\])", "N", why) for why in skipped).most_common(3)
    passing = sum(1 for why in skipped if retryable(why))
    way = (f"; {passing} of them failed alone (out of memory, a GPU error): once the cause is gone, a "
           f"restart by hand (r, or fleet restart) retries them" if passing else
           "; fix those rows or raise max_skip_fraction (fleet verify lists them)")
    return (f"skipped {len(skipped)} of {rows} rows ({len(skipped) / rows:.1%} > max_skip_fraction "
            f"{limit:g}): " + "; ".join(f"{why} ({n})" for why, n in reasons) + way)
