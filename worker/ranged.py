"""A [job] whose command takes its rows (`{start}`/`{end}`): its runner shares the host's rows with
the other shards of the host, as the built-in worker does (worker/leases.py, issue 33).

The runner is the pool member (it holds `<run dir>/.fleet/<shard>.alive` and the ledger is
`<run dir>/.fleet/leases-<first shard>.json`). It runs the command once per chunk of its lease,
with `{start}`/`{end}` the chunk's rows [start, end): a chunk, once started, is the command's to
finish, so chunks are cut as the worker reads rows — the lease's rest over twice the pool's size,
at most CHUNK_S of this shard's pace, at least `min_chunk` — and the rest of the lease can still be
stolen by a shard that ran dry. A chunk that exits 0 (after its done line, with `done` set) is
finished in the ledger: a restart, or a shard taking over a dead one's lease, starts after it. A
chunk that fails ends the launch with its exit code (the restart policy applies as to any job);
its rows stay this shard's lease. When no member of the pool holds rows any more, the launch
records `done` and exits 0.

Records written: `started` (the planned range, the run's rows), `leased` for each lease,
`progress` after each chunk (and the chunk's own progress lines, counted on from the rows already
finished; and every 2 s while it waits for a lease, so a wait for a holder's last chunk is never a
stall), `lease_moved` on a steal, `done` at the end. Standard library only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from . import protocol
from .leases import Lease, Move, Pool, tell_taken
from .ranges import shard_range


@dataclass(frozen=True)
class Chunk:
    """How one run of the command over rows [start, stop) ended."""
    code: int
    done_line: bool
    fail_line: bool


def fill(argv: list[str], start: int, stop: int) -> list[str]:
    """The command for rows [start, stop): `{start}`/`{end}` in each word (fleet/jobs.py left them)."""
    return [w.replace("{start}", str(start)).replace("{end}", str(stop)) for w in argv]


def run_rows(share: protocol.RowShare, shard_dir: str, launch: int, argv: list[str],
             run_chunk: Callable[..., Chunk],
             append: Callable[[protocol.Record], None], stopping: Callable[[], bool],
             needs_done_line: bool, started: dict | None = None) -> int:
    """The launch's exit code. `run_chunk(argv, start, stop, translate, alive_fd)` runs the command
    once over rows [start, stop) and reports how it ended; `translate` turns each record its log
    gives into the shard's (None: dropped); the command inherits `alive_fd` (the pool member's
    alive lock: no other shard takes its rows while it runs, even with this runner killed).
    `started`: more fields for `started` (a Slurm task's node)."""
    slot = int(os.path.basename(os.path.normpath(shard_dir)))
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(shard_dir)))
    ranges = {k: shard_range(share.num_rows, share.num_shards, k) for k in sorted({slot, *(share.pool or [])})}
    start, stop = ranges[slot]
    pool = Pool(run_dir, slot, ranges, share.num_rows)
    append(protocol.Started(launch=launch, pid=os.getpid(), shard=slot, num_shards=share.num_shards,
                            start=start, stop=stop, total=stop - start, num_rows=share.num_rows,
                            **(started or {})))
    try:
        lease: Lease | None = pool.own()
        move: Move | None = None

        def waiting() -> None:                     # a progress tick while it waits for a lease
            done, total = pool.counts()
            append(protocol.Progress(launch=launch, done=done, total=total))
        while True:
            if lease is None:
                if (got := pool.next(stopping, waiting)) is None:     # no member holds rows any more
                    break
                lease, move = got
                if move.how == "dead":            # what counts for it now: the chunks it finished
                    done = sum(b - a for a, b in pool.counted_for(move.source))
                    tell_taken(os.path.dirname(os.path.abspath(shard_dir)), move, move.stop - move.start,
                               done, done)
            code = _hold(pool, lease, move, share, launch, argv, run_chunk, append, stopping, needs_done_line)
            if code is not None:
                return code
            pool.finish()
            lease = None
        if stopping():
            return -15
        done, total = pool.counts()
        append(protocol.Done(launch=launch, done=done, total=total))
        return 0
    finally:
        pool.close()


def _hold(pool: Pool, lease: Lease, move: Move | None, share: protocol.RowShare, launch: int,
          argv: list[str], run_chunk, append, stopping, needs_done_line: bool) -> int | None:
    """Run the command over `lease` chunk by chunk; None once the lease is finished (or moved away),
    else the launch's exit code (a chunk failed, or the launch is being stopped)."""
    def given_up(m: Move) -> None:
        _, total = pool.counts()
        append(protocol.LeaseMoved(launch=launch, start=m.start, stop=m.stop, to_shard=m.target, why="stolen",
                                   rows=m.stop - m.start, total=total, holds=True))
    cell = pool.hold(lease, given_up, floor=max(1, share.min_chunk))
    how = move.how if move is not None else "plan"
    append(protocol.Leased(launch=launch, start=lease.start, stop=lease.stop, rows=lease.stop - lease.start,
                           epoch=lease.epoch, how=how,
                           from_shard=move.source if move is not None and move.source >= 0 else None,
                           from_host=move.origin if move is not None else None))
    at = lease.start
    while not stopping() and (rows := cell.claim(at, cell.window(at, lease.stop - at))) is not None:
        a, b = rows
        base, total = pool.counts()

        def translate(ev: protocol.Record) -> protocol.Record | None:
            if isinstance(ev, protocol.Sentinel) and ev.match == "done":
                return None                         # a chunk's done line: the launch is done at the end
            if isinstance(ev, protocol.Progress):
                return protocol.Progress(t=ev.t, launch=launch, done=base + min(ev.done, b - a), total=total)
            return ev
        chunk = run_chunk(fill(argv, a, b), a, b, translate, pool.alive_fd)
        if chunk.code != 0:
            return chunk.code
        if chunk.fail_line:
            return 1
        if needs_done_line and not chunk.done_line:
            append(protocol.Failed(launch=launch, reason=f"rows {a:,}–{b:,}: exited 0 without the done line"))
            return 0
        pool.complete(b)
        done, total = pool.counts()
        append(protocol.Progress(launch=launch, done=done, total=total))
        at = b
    if stopping():
        return -15
    if cell.lost:
        append(protocol.WarningEvent(launch=launch, message=cell.lost + ": stopped them"))
    return None

