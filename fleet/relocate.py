"""Rows of a lost host go to the live hosts (issue 33): decided here, carried out on the hosts by
`python -m worker.relocate` (adopt on a receiver, revoke on the lost host once it is back).

A host that answers but can do nothing more — every shard FATAL, or stopped by the user, while
its pool still holds rows (`idle`: a rented box whose one GPU is bad) — gives its rows away the
same way (issue 52): it is asked which of its rows are not done (`count`: `worker.relocate
pending`, under its ledger's lock), those are adopted by the others and then revoked there at
once, with the same records. Its finished rows stay its own (its disk is readable). A restart of
one of its shards (`r`) makes it a host that can take rows again. A host taken out of fleet.toml
whose shards the plan still has is a lost host from the start (`why` removed).

A host's own GPUs share its rows without a supervisor (worker/leases.py). Rows move *between*
hosts only while a supervisor is attached: a host unreachable for `[supervise] host_lost_after`
that still had work is lost; every row it is responsible for (its shards' planned rows, plus what
it adopted, less what already moved away from it) is split among the reachable hosts by their
shard count, and adopted into each one's pool. The rows it had finished are done again: its
output is on a disk nobody can read (`redone`). When it comes back, it is told (revoke) before
anything is launched there; the copies it wrote of moved rows belong to the receiver, and
`fleet verify --repair` removes them from it.

What moved is read from the hosts' records (`relocated`, both sides), so a supervisor restart
knows what its predecessor did; `Moves` also keeps what this supervisor has asked and not yet seen.
Everything here is pure: `orders` says what is due, the supervisor carries it out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker import protocol
from worker.leases import merge, subtract
from worker.ranges import shard_range

Runs = list[tuple[int, int]]


@dataclass
class Move:
    start: int
    stop: int
    from_host: str
    to_host: str
    t: float
    redone: int = 0
    told: bool = False         # the lost host has said it holds them no more (side "out")
    asked: bool = False        # asked by this supervisor, not yet in a record
    why: str = "lost"          # lost | idle | removed (protocol.Relocated.why)


@dataclass(frozen=True)
class Order:
    """One command to run: `kind` "adopt" on `host` (the receiver), "revoke" on `host` (the lost
    host, back; an idle host, at once) or "count" on `host` (an idle host: which rows are not done);
    `why` the move's reason (lost, idle, removed)."""
    kind: str
    host: str
    runs: tuple[tuple[int, int], ...]
    from_host: str
    to_host: str
    redone: int = 0
    why: str = "lost"


@dataclass
class Moves:
    """Every move the records show, by (rows, from, to)."""
    moves: dict[tuple, Move] = field(default_factory=dict)

    def seen(self, ev: protocol.Relocated) -> None:
        key = (ev.start, ev.stop, ev.from_host, ev.to_host)
        m = self.moves.get(key) or self._absorb(key, ev)
        if ev.side == "out":
            m.told = True
        else:
            m.asked = False
            m.redone = max(m.redone, ev.redone)

    def _absorb(self, key: tuple, ev: protocol.Relocated) -> Move:
        """A recorded move replaces what this supervisor asked of the same hosts over those rows."""
        for k, m in list(self.moves.items()):
            if m.asked and (m.from_host, m.to_host) == key[2:] and m.start < ev.stop and ev.start < m.stop:
                del self.moves[k]
        m = self.moves[key] = Move(ev.start, ev.stop, ev.from_host, ev.to_host, ev.t, why=ev.why)
        return m

    def ask(self, order: Order, t: float) -> None:
        for a, b in order.runs:
            self.moves.setdefault((a, b, order.from_host, order.to_host),
                                  Move(a, b, order.from_host, order.to_host, t, order.redone, asked=True,
                                       why=order.why))

    def withdraw(self, order: Order) -> None:
        """The order's asked moves no record will show: refused, or already recorded before."""
        for a, b in order.runs:
            m = self.moves.get((a, b, order.from_host, order.to_host))
            if m is not None and m.asked:
                del self.moves[(a, b, order.from_host, order.to_host)]

    def away_from(self, host: str) -> list[Move]:
        return [m for m in self.moves.values() if m.from_host == host]

    def into(self, host: str) -> list[Move]:
        return [m for m in self.moves.values() if m.to_host == host and not m.asked]

    def moved_to(self, host: str, since: float | None) -> str | None:
        """Where the rows of a shard of `host` went, if they moved after its last lease (`since`)."""
        if not self.moves:                 # (asked of every shard for every picture)
            return None
        later = [m for m in self.away_from(host) if since is None or m.t >= since]
        return later[-1].to_host if later else None

    def untold(self, host: str) -> list[Move]:
        """Moves away from `host` it has not yet been told of (recorded on the receiver)."""
        return [m for m in self.away_from(host) if not m.told and not m.asked]

    def untold_hosts(self) -> set[str]:
        """Every host with moves away from it that it has not yet been told of."""
        return {m.from_host for m in self.moves.values() if not m.told and not m.asked}

    @property
    def in_flight(self) -> bool:
        """A move asked and not yet in the receiver's record: its rows are nobody's done work yet
        (the receiver's shards may all read DONE until its record says they have work again)."""
        return any(m.asked for m in self.moves.values())

    @property
    def rows(self) -> int:
        return sum(m.stop - m.start for m in self.moves.values() if not m.asked)

    @property
    def redone(self) -> int:
        return sum(m.redone for m in self.moves.values() if not m.asked)


@dataclass(frozen=True)
class HostFacts:
    """What `orders` needs to know of a host, read from the store."""
    name: str
    shards: tuple[int, ...]
    lost: bool                  # unreachable for host_lost_after
    usable: bool                # reachable and replayed: can take rows, or be told
    had_work: bool              # a shard of it was not DONE when last heard of
    finished_rows: int = 0      # rows its records counted finished (done and skipped)
    planned: tuple[tuple[int, int], ...] = ()   # its shards' planned rows
    idle: bool = False          # usable, but every shard FATAL, STOPPED or DONE and one holds rows
    unfinished: tuple[tuple[int, int], ...] | None = None   # an idle host's rows not done (its count)
    removed: bool = False       # the plan has shards there, fleet.toml no longer lists it


def planned_rows(shards: dict[int, tuple[int, int] | None], num_rows: int | None,
                 num_shards: int) -> Runs:
    """The rows the plan gives these shards: what their records said, else from the dataset's rows."""
    runs = []
    for k, r in shards.items():
        if r is None and num_rows is not None:
            r = shard_range(num_rows, num_shards, k)
        if r is not None:
            a, b = r
            runs.append((a, b))
    return merge(runs)


def rows_of(host: HostFacts, moves: Moves) -> Runs:
    """The rows `host` answers for now: planned and adopted, less those moved away from it."""
    adopted = [(m.start, m.stop) for m in moves.into(host.name)]
    away = [(m.start, m.stop) for m in moves.away_from(host.name)]
    return subtract(merge(list(host.planned) + adopted), away)


def split(runs: Runs, weights: dict[str, int]) -> dict[str, Runs]:
    """`runs` cut in contiguous pieces, one a host, in proportion to its weight (its shards)."""
    total, rows = sum(weights.values()), sum(b - a for a, b in runs)
    out: dict[str, Runs] = {}
    if not total or not rows:
        return out
    names, given, acc = sorted(weights), 0, 0
    bounds = []
    for name in names:                      # each host's share, cumulative, exact in the end
        acc += weights[name]
        bounds.append(rows * acc // total)
    pieces = iter(zip(names, bounds))
    name, bound = next(pieces)
    for a, b in runs:
        while a < b:
            while given >= bound:
                name, bound = next(pieces)
            take = min(b - a, bound - given)
            out.setdefault(name, []).append((a, a + take))
            a, given = a + take, given + take
    return out


def orders(hosts: list[HostFacts], moves: Moves) -> list[Order]:
    """What is due now: every lost host that had work has its rows adopted by the usable ones,
    an idle host its unfinished rows (counted first), and every host that is back (or idle) is
    told of the moves away from it before anything more is done there."""
    out = [order for h in hosts for order in _revokes(h, moves)]
    receivers = _receivers(hosts, moves)
    if not receivers:
        return out
    for h in hosts:
        if not _gives_rows(h):
            continue
        if h.idle and h.unfinished is None:
            out.append(Order("count", h.name, (), h.name, h.name, why="idle"))
            continue
        out += _adoptions(h, moves, receivers)
    return out


def _revokes(h: HostFacts, moves: Moves) -> list[Order]:
    """A usable host told of the moves away from it it has not been told of, one order per
    receiver and reason."""
    untold = moves.untold(h.name) if h.usable else []
    by_target: dict[tuple[str, str], Runs] = {}
    for m in untold:
        by_target.setdefault((m.to_host, m.why), []).append((m.start, m.stop))
    return [Order("revoke", h.name, tuple(merge(r)), h.name, to, why=why) for (to, why), r in sorted(by_target.items())]


def _receivers(hosts: list[HostFacts], moves: Moves) -> dict[str, int]:
    """The hosts that may take rows now, by their shard count: usable, neither lost nor idle, with
    shards, and told of every move away from them."""
    return {h.name: len(h.shards) for h in hosts
            if h.usable and not h.lost and not h.idle and h.shards and not moves.untold(h.name)}


def _gives_rows(h: HostFacts) -> bool:
    """Whether `h`'s rows go to the others: lost while it had work, or idle and reachable."""
    return (h.lost and h.had_work) or (h.idle and not h.lost)


def _adoptions(h: HostFacts, moves: Moves, receivers: dict[str, int]) -> list[Order]:
    """The rows `h` gives away, split among the receivers: an idle host's unfinished rows (none
    of its finished ones redone), a lost or removed host's every row (its finished ones redone,
    each receiver its share of them)."""
    if h.unfinished is not None and h.idle:
        runs = subtract(list(h.unfinished), [(m.start, m.stop) for m in moves.away_from(h.name)])
        finished, why = 0, "idle"
    else:
        runs, finished, why = rows_of(h, moves), h.finished_rows, "removed" if h.removed else "lost"
    rows = sum(b - a for a, b in runs)
    out = []
    for to, part in split(runs, receivers).items():
        share = sum(b - a for a, b in part)
        out.append(Order("adopt", to, tuple(part), h.name, to, redone=finished * share // rows if rows else 0,
                         why=why))
    return out


WHY_WORDS = {"lost": "lost", "idle": "no shard of it can go on", "removed": "no longer in fleet.toml"}


def order_line(order: Order) -> str:
    """The log view's line for a move: 'rows 41,200–45,000 of gpubox3 (lost) → gpubox1'."""
    rows = ", ".join(f"{a:,}–{b:,}" for a, b in order.runs[:3]) + (" …" if len(order.runs) > 3 else "")
    n = sum(b - a for a, b in order.runs)
    why = WHY_WORDS.get(order.why, order.why)
    if order.kind == "adopt":
        return f"rows {rows} of {order.from_host} ({why}) → {order.to_host} ({n:,} rows)"
    if order.kind == "count":
        return f"{order.host}: {why}: counting the rows it has not done, for the other hosts"
    if order.why == "idle":
        return f"{order.host}: its rows {rows} went to {order.to_host} ({why}): marking them gone there"
    return f"{order.host}: back; its rows {rows} went to {order.to_host} while it was lost: stopping them there"
