"""Leases of rows among the shards of one host (issue 33): a dead GPU's rows are finished by the
host's other GPUs, and the host's GPUs finish together, with no supervisor attached.

The shards of a host that write one output folder form a pool (`--pool`). Their ledger,
`<out>/.fleet/leases-<first shard>.json`, starts with each shard holding its planned range (so a
run where nothing fails or lags is exactly a run of fixed shards) and changes only under its
flock, through the pure methods of `Ledger`:

- a shard that finishes its lease takes over the lease of a pool member whose process is gone
  (its `.fleet/<shard>.alive` flock is free: crashed, FATAL, never started); rows the dead holder
  finished are in its manifest and are skipped;
- else it asks the live holder with the largest unread remainder for the second half of it: the
  holder's poller answers at its next tick, cutting its own lease no lower than the rows it has
  already read (`Cell.frontier`), and only then does the thief start: no row is done twice on
  purpose;
- else, while any other member still holds rows, it waits (a late death is then taken over at
  once); when no one holds any, the pool is done.

Between hosts, rows move only while a supervisor is attached (fleet/relocate.py): the rows of a
host lost for `[supervise] host_lost_after` are `adopt`ed into a live host's ledger as free rows
(its members take them before stealing), and when the lost host comes back its ledger is told they
are `gone` (`revoke`): its held leases go, its holders stop those rows at their next tick, and the
copies it wrote of them are no longer its own (`worker.verify --repair` removes them).

Each lease carries an epoch; a holder whose lease is no longer in the ledger under its epoch
stops those rows. `Ledger.problems` states the invariants the tests check after every step: every
row is held by at most one shard, held ∪ done ∪ free ∪ gone = the pool's rows and the adopted
ones, no done row is held again.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

from . import protocol
from .files import write_atomic

POLL_S = 0.5            # how often a holder reads the ledger (answers a steal, checks its epoch)
STEAL_WAIT_S = 30.0     # a steal not answered by then (a stopped holder) is withdrawn
MIN_STEAL = 2           # rows: a remainder smaller than this is left to its holder
MIN_WINDOW = 64         # rows: the smallest chunk a shared lease is read in
CHUNK_S = 120.0         # a chunk holds at most this much of its shard's own work (its rate so far)
WAIT_BEAT_S = 2.0       # a shard waiting for a lease says so this often (its progress, unchanged)


@dataclass
class Lease:
    start: int
    stop: int
    epoch: int
    at: int                   # the holder's frontier: rows below it are read (being done or done)

    @property
    def remainder(self) -> int:
        return self.stop - self.at


@dataclass
class Move:
    """Rows [start, stop) going from `source` to `target`: `how` "dead", "stolen", "reopened",
    "adopted" (rows of the lost host `origin`; `source` is then -1) or "freed" (the rest of a
    lease a revoke stopped; `source` -1)."""
    start: int
    stop: int
    source: int
    target: int
    how: str
    epoch: int
    origin: str | None = None


@dataclass
class Ledger:
    held: dict[int, Lease] = field(default_factory=dict)
    done: list[list[int]] = field(default_factory=list)     # finished leases: [a, b, the shard it counts for]
    steals: dict[int, int] = field(default_factory=dict)    # victim -> thief
    asked_t: dict[int, float] = field(default_factory=dict) # thief -> when it asked
    epoch: int = 0
    ranges: dict[int, list[int]] = field(default_factory=dict)   # the plan's: another plan, another ledger
    free: list[list] = field(default_factory=list)    # rows adopted from a lost host: [a, b, its name]
                                                      # (None: the rest of a lease a revoke stopped)
    gone: list[list] = field(default_factory=list)    # rows moved to another host: [a, b, its name]
    idle: list[int] = field(default_factory=list)     # members that ran dry and left: rows adopted reopen them

    @classmethod
    def planned(cls, ranges: dict[int, tuple[int, int]]) -> "Ledger":
        ledger = cls(ranges={k: list(v) for k, v in ranges.items()})
        for slot in sorted(ranges):
            a, b = ranges[slot]
            ledger.epoch += 1
            if b > a:
                ledger.held[slot] = Lease(a, b, ledger.epoch, a)
        return ledger

    # --- changes ---------------------------------------------------------------------------

    def finish(self, slot: int) -> None:
        """`slot` finished its lease: its rows are done, and count for `slot` (the rows a dead
        holder had finished in a lease taken over go with the lease)."""
        lease = self.held.pop(slot, None)
        if lease is not None and lease.stop > lease.start:
            self.done.append([lease.start, lease.stop, slot])
        self._forget(slot)

    def take_over(self, thief: int, victim: int) -> Move:
        """The whole lease of `victim` (whose process is gone) to `thief`, which holds none."""
        assert thief not in self.held and victim in self.held and thief != victim
        lease = self.held.pop(victim)
        self._forget(victim)
        self.withdraw(thief)
        self.epoch += 1
        self.held[thief] = Lease(lease.start, lease.stop, self.epoch, lease.start)
        return Move(lease.start, lease.stop, victim, thief, "dead", self.epoch)

    def reopen(self, slot: int, unfinished: Callable[[int, int], bool]) -> Move | None:
        """A finished lease with rows no manifest holds any more (`fleet verify --repair` dropped
        them) held again, by `slot`, which holds none; None when there is none."""
        if slot in self.held:
            return None
        for entry in self.done:
            a, b, owner = entry
            if unfinished(a, b):
                self.done.remove(entry)
                self.epoch += 1
                self.held[slot] = Lease(a, b, self.epoch, a)
                return Move(a, b, owner, slot, "reopened", self.epoch)
        return None

    def complete(self, slot: int, upto: int) -> None:
        """`slot` finished the rows of its lease below `upto` (a chunk of a [job] that takes its
        rows): they are done and count for it, and its lease starts at `upto` (a restart or a
        taker resumes there)."""
        lease = self.held[slot]
        upto = min(upto, lease.stop)
        if upto <= lease.start:
            return
        joined = next((e for e in self.done if e[1] == lease.start and e[2] == slot), None)
        if joined is not None:                  # one entry for a run of chunks
            joined[1] = upto
        else:
            self.done.append([lease.start, upto, slot])
        lease.start, lease.at = upto, max(lease.at, upto)

    def take_free(self, thief: int) -> Move:
        """The first run of adopted rows to `thief`, which holds none (its pool mates steal
        halves of it as they run dry, as of any lease)."""
        assert thief not in self.held and self.free
        a, b, origin = self.free.pop(0)
        self.withdraw(thief)
        self.epoch += 1
        self.held[thief] = Lease(a, b, self.epoch, a)
        return Move(a, b, -1, thief, "adopted" if origin is not None else "freed", self.epoch, origin)

    def adopt(self, runs: list[tuple[int, int]], origin: str) -> list[tuple[int, int]]:
        """Rows of the lost host `origin` become free rows of this pool; rows it already has
        (a retried command) are not added twice. Returns the runs added."""
        have = merge([(l.start, l.stop) for l in self.held.values()] + [(a, b) for a, b, _ in self.done] +
                     [(a, b) for a, b, _ in self.free])
        new = subtract(merge(runs), have)
        self.gone = [[a, b, h] for a, b, h in _cut(self.gone, new)]
        self.free += [[a, b, origin] for a, b in new]
        return new

    def revoke(self, runs: list[tuple[int, int]], target: str) -> list[int]:
        """Rows moved to the host `target` while this one was lost are no longer this pool's: a
        held lease touching them goes (its holder stops; its other rows become free), a finished
        one keeps only its other rows. Returns the holders whose lease went."""
        runs = merge(runs)
        lost = []
        for slot, lease in list(self.held.items()):
            if lease.stop > lease.start and subtract([(lease.start, lease.stop)], runs) != [(lease.start, lease.stop)]:
                del self.held[slot]
                self._forget(slot)
                lost.append(slot)
                self.free += [[a, b, None] for a, b in subtract([(lease.start, lease.stop)], runs)]
        self.done = [list(r) for r in _cut(self.done, runs)]
        self.free = [list(r) for r in _cut(self.free, runs)]
        self.gone = [list(r) for r in _cut(self.gone, runs)] + [[a, b, target] for a, b in runs]
        self.gone.sort()
        return lost

    def ask(self, thief: int, victim: int, t: float) -> None:
        assert thief not in self.held and victim in self.held and victim not in self.steals
        self.withdraw(thief)
        self.steals[victim], self.asked_t[thief] = thief, t

    def withdraw(self, thief: int) -> None:
        for victim in [v for v, th in self.steals.items() if th == thief]:
            del self.steals[victim]
        self.asked_t.pop(thief, None)

    def answer(self, victim: int, frontier: int) -> Move | None:
        """`victim` answers the steal asked of it, having read its rows up to `frontier`: the
        second half of what it has not read goes to the thief (None when nothing is left to give)."""
        thief = self.steals.pop(victim, None)
        if thief is None:
            return None
        self.asked_t.pop(thief, None)
        lease = self.held[victim]
        lease.at = max(lease.at, min(frontier, lease.stop))
        cut = lease.at + (lease.stop - lease.at + 1) // 2
        if lease.stop - cut < 1 or thief in self.held:
            return None
        self.epoch += 1
        self.held[thief] = Lease(cut, lease.stop, self.epoch, cut)
        move = Move(cut, lease.stop, victim, thief, "stolen", self.epoch)
        lease.stop = cut
        return move

    def counted(self, slot: int) -> list[tuple[int, int]]:
        """The finished leases that count for `slot`."""
        return [(a, b) for a, b, s in self.done if s == slot]

    def read_up_to(self, slot: int, frontier: int) -> None:
        lease = self.held.get(slot)
        if lease is not None:
            lease.at = max(lease.at, min(frontier, lease.stop))

    def _forget(self, slot: int) -> None:
        self.steals.pop(slot, None)
        self.withdraw(slot)

    # --- questions ------------------------------------------------------------------------

    def victim(self, thief: int, alive: Callable[[int], bool]) -> tuple[str, int] | None:
        """What `thief` (holding nothing) should do: ("dead", slot) to take over, ("steal", slot)
        to ask, ("wait", slot) while a live holder's rows are too few to split, ("free", -1) to
        take adopted rows; None: all done."""
        if self.free:
            return "free", -1
        others = [s for s in self.held if s != thief]
        dead = [s for s in others if not alive(s)]
        if dead:
            return "dead", max(dead, key=lambda s: self.held[s].stop - self.held[s].start)
        open_ = [s for s in others if s not in self.steals and self.held[s].remainder >= MIN_STEAL]
        if open_:
            return "steal", max(open_, key=lambda s: self.held[s].remainder)
        return ("wait", others[0]) if others else None

    def problems(self, rows: list[tuple[int, int]]) -> list[str]:
        """The invariants, against the rows the pool must account for (its own and those it
        adopted): held, done, free and gone disjoint and covering them."""
        spans = [(l.start, l.stop, f"held by {s}") for s, l in self.held.items()] + \
                [(a, b, "done") for a, b, _ in self.done] + [(a, b, "free") for a, b, _ in self.free] + \
                [(a, b, "gone") for a, b, _ in self.gone]
        spans = sorted(sp for sp in spans if sp[1] > sp[0])      # an empty lease (all its chunks done) holds no row
        out, end = [], None
        for a, b, what in spans:
            if end is not None and a < end:
                out.append(f"rows {a}-{min(b, end)} twice ({what})")
            end = b if end is None else max(end, b)
        covered = sorted((a, b) for a, b, _ in spans if b > a)
        if merge(covered) != merge(sorted(rows)):
            out.append(f"held, done, free and gone {merge(covered)} are not the pool's rows {merge(sorted(rows))}")
        for s, l in self.held.items():
            if not l.start <= l.at <= l.stop:
                out.append(f"{s}: frontier {l.at} outside {l.start}-{l.stop}")
        return out

    def check(self, num_rows: int | None = None) -> str | None:
        """The first thing this ledger says that cannot be (None: none): an entry backwards, or
        outside the dataset's `num_rows`; a lease whose epoch is past the ledger's (epochs only
        grow); a frontier outside its lease; two entries over one row; a row of the plan's ranges
        that no entry accounts for. A ledger is input like any file on a disk (issue 53)."""
        entries = [(f"held lease of shard {s}", l.start, l.stop) for s, l in self.held.items()] + \
            [(f"{kind} [{', '.join(map(str, e))}]", e[0], e[1])
             for kind, rows in (("done", self.done), ("free", self.free), ("gone", self.gone)) for e in rows]
        for what, a, b in entries:
            if not (isinstance(a, int) and isinstance(b, int)) or not 0 <= a <= b or \
                    (num_rows is not None and b > num_rows):
                within = f"the dataset's {num_rows:,} rows" if num_rows is not None else "rows 0 and up"
                return f"{what}: rows {a}–{b} are not within {within}"
        for s, lease in self.held.items():
            if lease.epoch > self.epoch:
                return f"held lease of shard {s}: epoch {lease.epoch} is past the ledger's {self.epoch} (epochs only grow)"
            if not lease.start <= lease.at <= lease.stop:
                return f"held lease of shard {s}: frontier {lease.at} outside rows {lease.start}–{lease.stop}"
        spans = sorted((a, b, what) for what, a, b in entries if b > a)
        for (a0, b0, w0), (a1, b1, w1) in zip(spans, spans[1:]):
            if a1 < b0:
                return f"{w1}: rows {a1}–{min(b0, b1)} are also in {w0}"
        planned = merge([(a, b) for a, b in self.ranges.values()])
        if lost := subtract(planned, merge([(a, b) for a, b, _ in spans])):
            return f"rows {lost[0][0]}–{lost[0][1]} of the pool's plan are in no entry (held, done, free or gone)"
        return None

    def reopen_unfinished(self, slot: int, unfinished: Callable[[int, int], bool]) -> Move | None:
        """Every finished lease with rows no manifest holds (verify --repair dropped them, or the
        ledger claimed them done and they never were): the first is held again by `slot` (`reopen`),
        the rest become free rows the pool's members take, so that none stays claimed and undone."""
        move = self.reopen(slot, unfinished)
        for entry in list(self.done):
            a, b, _ = entry
            if unfinished(a, b):
                self.done.remove(entry)
                self.free.append([a, b, None])
        return move

    # --- storage --------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps({"held": {str(k): asdict(v) for k, v in self.held.items()}, "done": self.done,
                           "steals": {str(k): v for k, v in self.steals.items()},
                           "asked_t": {str(k): v for k, v in self.asked_t.items()}, "epoch": self.epoch,
                           "ranges": {str(k): list(v) for k, v in self.ranges.items()},
                           "free": self.free, "gone": self.gone, "idle": self.idle})

    @classmethod
    def from_json(cls, text: str) -> "Ledger":
        d = json.loads(text)
        return cls(held={int(k): Lease(**v) for k, v in d["held"].items()}, done=[list(r) for r in d["done"]],
                   steals={int(k): int(v) for k, v in d["steals"].items()},
                   asked_t={int(k): float(v) for k, v in d["asked_t"].items()}, epoch=int(d["epoch"]),
                   ranges={int(k): list(v) for k, v in d.get("ranges", {}).items()},
                   free=[list(r) for r in d.get("free", [])], gone=[list(r) for r in d.get("gone", [])],
                   idle=[int(k) for k in d.get("idle", [])])


def merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(runs: list[tuple[int, int]], away: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The rows of `runs` not in `away` (both sorted, merged runs), as runs."""
    out, away = [], merge(away)
    for a, b in merge(runs):
        for c, d in away:
            if d <= a or c >= b:
                continue
            if c > a:
                out.append((a, c))
            a = max(a, d)
        if a < b:
            out.append((a, b))
    return out


def _cut(entries: list[list], away: list[tuple[int, int]]) -> list[tuple]:
    """Entries [a, b, tag] less the rows of `away`, each piece keeping its tag."""
    return [(x, y, tag) for a, b, tag in entries for x, y in subtract([(a, b)], away)]


class Cell:
    """The lease the worker's row reader is in, shared with the poller thread: the reader admits a
    row only below `stop`, and a steal cuts `stop` no lower than the rows already admitted."""

    def __init__(self, start: int, stop: int, shares: int = 2, floor: int = MIN_WINDOW):
        self.start, self.stop, self.frontier = start, stop, start
        self.shares = shares              # the pool's shards: more than one may steal from it
        self.floor = floor                # the smallest window (a [job]'s min_chunk)
        self.began: float | None = None   # when the first row was admitted (monotonic)
        self.lost: str | None = None
        self.lock = threading.Lock()

    @property
    def shared(self) -> bool:
        return self.shares > 1

    def admit(self, index: int) -> bool:
        return self.claim(index, 1) is not None

    def claim(self, index: int, rows: int) -> tuple[int, int] | None:
        """Rows [index, end) read at once (up to `rows`, below `stop`); None when none is left."""
        with self.lock:
            end = min(self.stop, index + rows)
            if index >= end or self.lost:
                return None
            self.frontier = max(self.frontier, end)
            self.began = self.began or time.monotonic()
            return index, end

    def window(self, index: int, most: int) -> int:
        """Rows to read (and sort by length) from `index` before the next look at `stop`: once
        read, rows can no longer be stolen, so a shared lease is read in chunks of its rest over
        twice the pool's size (guided self-scheduling: chunks shrink as the lease does) and of at
        most CHUNK_S of this shard's own pace — a slow GPU never sits on rows the others could
        have done. At least MIN_WINDOW, so batches still sort by length."""
        if not self.shared:
            return most
        rows = (self.stop - index) // (2 * self.shares)
        spent = time.monotonic() - self.began if self.began is not None else 0.0
        if spent >= 1.0:
            rows = min(rows, int((self.frontier - self.start) / spent * CHUNK_S))
        return min(most, max(self.floor, rows))


def _retire(ledger: Ledger, slot: int) -> bool:
    """`slot` leaves if the pool has no rows left: then it is idle (under the same lock as the
    look, so an adoption after it finds it there and reopens it)."""
    if ledger.held or ledger.free:
        return False
    if slot not in ledger.idle:
        ledger.idle.append(slot)
    return True


def ledger_path(out_dir: str, ranges: dict[int, tuple[int, int]]) -> str:
    """Where the pool of these shards keeps its ledger: named by its first shard."""
    return os.path.join(out_dir, ".fleet", f"leases-{min(ranges)}.json")


def ledger_files(out: str) -> list[str]:
    """Every pool ledger of an output folder (one per pool of shards writing there)."""
    return sorted(glob.glob(os.path.join(out, ".fleet", "leases-*.json")))


def moved_away(out: str) -> dict[str, list[list]]:
    """Manifest file name -> the rows its shard's pool gave to another host while this one was
    lost ([a, b, that host]: the pool ledgers' `gone`, worker/leases.py)."""
    gone: dict[str, list[list]] = {}
    for path in ledger_files(out):
        try:
            with open(path) as f:
                ledger = Ledger.from_json(f.read())
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for k in ledger.ranges:
            gone[f"{k}.jsonl"] = ledger.gone
    return gone


def gone_to(gone: dict[str, list[list]], manifest: str, index: int) -> str | None:
    """The host that row `index` of `manifest`'s shard moved to (`moved_away`), if it moved."""
    return next((host for a, b, host in gone.get(manifest, ()) if a <= index < b), None)


class LedgerError(ValueError):
    """A pool ledger that says what cannot be: one line naming the file and the entry."""


@contextlib.contextmanager
def open_ledger(path: str, ranges: dict[int, tuple[int, int]], num_rows: int | None = None,
                check: bool = True) -> Iterator[Ledger]:
    """The ledger at `path` under its flock (the planned one where there is none, or where it was
    another plan's: a replan's manifests say what is done, not it), saved after if changed. The
    one door for the pool's shards and for `worker.relocate`. A ledger that is there and is no
    ledger, or says what cannot be (`Ledger.check`, against the dataset's `num_rows` where known),
    raises LedgerError: never an assertion, a hang or a false "finished" further on."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        fresh = Ledger.planned(ranges)
        try:
            with open(path) as f:
                text = f.read()
        except FileNotFoundError:
            text = None
        except OSError as e:
            raise LedgerError(f"{path}: cannot be read: {e.strerror}") from None
        try:
            ledger = fresh if text is None else Ledger.from_json(text)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise LedgerError(f"{path}: not a ledger ({type(e).__name__}: {str(e)[:120]}): remove it to start "
                              f"from the plan (the manifests say what is done)") from None
        if ledger.ranges != fresh.ranges:
            ledger = fresh
        if check and (why := ledger.check(num_rows)) is not None:      # (a repair opens it to mend it)
            raise LedgerError(f"{path}: {why}")
        before = ledger.to_json()
        yield ledger
        after = ledger.to_json()
        if after != before:
            write_atomic(path, after, sync=False)


def tell_taken(shards_dir: str, move: Move, unfinished: int, total: int, done: int, skipped: int = 0) -> None:
    """A dead shard's lease taken over: said in that shard's own record (`shards_dir`/<source>,
    beside the taker's), so that fleet shows where its rows went and that it holds none; `total`,
    `done`, `skipped`: what still counts for it."""
    event = protocol.LeaseMoved(start=move.start, stop=move.stop, to_shard=move.target, why="dead",
                                rows=unfinished, total=total, done=done, skipped=skipped, holds=False)
    with contextlib.suppress(OSError):
        protocol.append_jsonl(os.path.join(shards_dir, str(move.source), protocol.EVENTS_FILE), event)


def slot_alive(work: str, slot: int) -> bool:
    """Whether shard `slot`'s process holds its `<work>/<slot>.alive` flock (a prober takes it
    for microseconds only)."""
    with open(os.path.join(work, f"{slot}.alive"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


class Pool:
    """One shard's side of its host's ledger. `alive` holds `.fleet/<slot>.alive` for the
    process's life: the others' test of whether this shard is gone."""

    def __init__(self, out_dir: str, slot: int, ranges: dict[int, tuple[int, int]], num_rows: int | None = None):
        work = os.path.join(out_dir, ".fleet")
        os.makedirs(work, exist_ok=True)
        self.slot, self.ranges, self.work, self.num_rows = slot, ranges, work, num_rows
        self.path = ledger_path(out_dir, ranges)
        self._alive = open(os.path.join(work, f"{slot}.alive"), "a")
        fcntl.flock(self._alive, fcntl.LOCK_EX)          # a prober holds it for microseconds only
        self.cell: Cell | None = None
        self.epoch: int | None = None
        self.on_move: Callable[[Move], None] = lambda move: None
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()

    def ledger(self):
        """The ledger under its lock (made from the planned ranges on first use), saved after."""
        return open_ledger(self.path, self.ranges, self.num_rows)

    @property
    def alive_fd(self) -> int:
        """The alive lock's descriptor: a process this member starts to do its rows (a [job]'s
        chunk) inherits it, so the shard counts as alive — and its lease is nobody else's — until
        every process of it is gone, even where the member itself was killed first."""
        return self._alive.fileno()

    def alive(self, slot: int) -> bool:
        return slot == self.slot or slot_alive(self.work, slot)

    def own(self) -> Lease | None:
        """The lease this shard holds (its planned range on a first launch; what it held when it
        last stopped, unless another shard has taken it over since)."""
        with self.ledger() as ledger:
            if self.slot in ledger.idle:
                ledger.idle.remove(self.slot)
            lease = ledger.held.get(self.slot)
            return None if lease is None else Lease(**asdict(lease))

    def reopen(self, unfinished: Callable[[int, int], bool]) -> Move | None:
        with self.ledger() as ledger:
            return ledger.reopen_unfinished(self.slot, unfinished)

    def empty(self) -> bool:
        """No member holds rows and none are free: this shard leaves (idle, so that rows adopted
        later reopen it)."""
        with self.ledger() as ledger:
            return _retire(ledger, self.slot)

    def counted(self) -> list[tuple[int, int]]:
        return self.counted_for(self.slot)

    def counted_for(self, slot: int) -> list[tuple[int, int]]:
        with self.ledger() as ledger:
            return ledger.counted(slot)

    def finish(self) -> None:
        with self.ledger() as ledger:
            if ledger.held.get(self.slot) is not None and ledger.held[self.slot].epoch == self.epoch:
                ledger.finish(self.slot)
        self.cell = self.epoch = None

    def next(self, stopping: Callable[[], bool] = lambda: False,
             beat: Callable[[], None] = lambda: None) -> tuple[Lease, Move] | None:
        """This shard's next lease once it holds none: a dead member's, or half a live one's; None
        when no member holds rows any more. Waits while a steal is answered or a holder finishes,
        calling `beat` every WAIT_BEAT_S meanwhile (the shard says it is alive: a wait for a
        holder's last chunk can outlast a stall_timeout)."""
        asked: int | None = None
        beaten = time.monotonic()
        while not stopping():
            if time.monotonic() - beaten >= WAIT_BEAT_S:
                beat()
                beaten = time.monotonic()
            with self.ledger() as ledger:
                lease = ledger.held.get(self.slot)
                if lease is not None and asked is not None:
                    return Lease(**asdict(lease)), Move(lease.start, lease.stop, asked, self.slot, "stolen",
                                                        lease.epoch)
                pending = asked is not None and asked in ledger.steals and \
                    time.time() - ledger.asked_t.get(self.slot, 0) < STEAL_WAIT_S and self.alive(asked)
                if not pending:
                    ledger.withdraw(self.slot)
                    asked = None
                    choice = ledger.victim(self.slot, self.alive)
                    if choice is None:
                        _retire(ledger, self.slot)
                        return None
                    what, victim = choice
                    if what == "free":
                        move = ledger.take_free(self.slot)
                        return Lease(**asdict(ledger.held[self.slot])), move
                    if what == "dead":
                        move = ledger.take_over(self.slot, victim)
                        return Lease(**asdict(ledger.held[self.slot])), move
                    if what == "steal":
                        ledger.ask(self.slot, victim, time.time())
                        asked = victim
            time.sleep(POLL_S / 2)
        return None

    def complete(self, upto: int) -> None:
        """The rows of this shard's lease below `upto` are finished (Ledger.complete), unless the
        lease is no longer its own."""
        with self.ledger() as ledger:
            lease = ledger.held.get(self.slot)
            if lease is not None and lease.epoch == self.epoch:
                ledger.complete(self.slot, upto)

    def counts(self) -> tuple[int, int]:
        """(rows finished, rows) that count for this shard: its finished leases (and chunks), and
        what it holds now."""
        with self.ledger() as ledger:
            done = sum(b - a for a, b in ledger.counted(self.slot))
            lease = ledger.held.get(self.slot)
            return done, done + (lease.stop - lease.start if lease is not None else 0)

    def hold(self, lease: Lease, on_move: Callable[[Move], None] = lambda move: None,
             floor: int = MIN_WINDOW) -> Cell:
        """Work on `lease`: its cell for the row reader, and the poller answering steals (told to
        `on_move` once the cut is made)."""
        self.on_move = on_move
        self.epoch, self.cell = lease.epoch, Cell(lease.start, lease.stop, shares=len(self.ranges), floor=floor)
        if self._poller is None:
            self._poller = threading.Thread(target=self._poll, name="leases", daemon=True)
            self._poller.start()
        return self.cell

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            cell = self.cell
            if cell is None:
                continue
            try:
                self.tick(cell)
            except Exception:               # the ledger unreadable for a moment: next tick
                continue

    def tick(self, cell: Cell) -> Move | None:
        """Publish the frontier, answer a steal (cutting the cell's stop first), check the epoch."""
        with self.ledger() as ledger:
            lease = ledger.held.get(self.slot)
            if lease is None or lease.epoch != self.epoch:
                with cell.lock:
                    cell.lost = (f"rows {cell.start}-{cell.stop} are no longer this shard's "
                                 f"(lease epoch {self.epoch} gone from {self.path})")
                return None
            with cell.lock:
                move = ledger.answer(self.slot, cell.frontier) if self.slot in ledger.steals else None
                if move is not None:
                    cell.stop = move.start
                ledger.read_up_to(self.slot, cell.frontier)
        if move is not None:
            self.on_move(move)
        return move

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._alive.close()
