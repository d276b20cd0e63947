"""Small pure figures of one shard's attempt, each readable and tested alone: how long its work
will take (the cost of the work left, fitted to the attempt's batches) and how late its progress is.

Why not tokens/s over the last 30 s, or any rate measured so far: rows come longest first and a
long row costs more per token (its attention grows with its length: 4.8x per token at 4,096 tokens
than at 32 for the demo's model on a CPU), so a rate measured on the long rows runs long for the
short ones, and a 30 s window of batch-at-a-time progress swings by minutes within seconds. The
worker sends what the work costs (`total_rows`, `total_tokens`, `total_sq_tokens` for the whole
shard, the same counted over the rows done, and `attention_weight`: its FLOP model's, or on a
CPU the one it timed at load), each batch timed from the write that counted it (`counted_t`), and
the ETA is the fitted cost of the work left (`fit_cost`, `pace_eta`); a record without them (an older
worker, a [job]) is timed by its pace over the last 2 minutes, in tokens or samples, as before.
Until the attempt has 3 minutes of progress behind it the ETA says it is rough ("~").
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from dataclasses import dataclass
from typing import Sequence

from worker import protocol

from .record import ShardRecord

PACE_WINDOW_S = 120.0        # the pace looks back this far at most (it drifts as rows get shorter)
SETTLED_S = 180.0            # a fit over this much progress is shown as it is, else as "~"
LATE_FACTOR = 3.0            # progress later than this many usual intervals: LATE (the judge's state)
LATE_MIN_S = 10.0            # ...and never for less than this (a fast shard's jitter, a busy box)
USUAL_OF = 8                 # the usual interval: the median of this many latest gaps
RESTART_SETTLE_S = 60.0      # after a restart (caches cold, the host busy) batches are left out this long
REFIT_S = 30.0               # the fit is redone at most this often once the attempt has 40 points
GROUP_S = 10.0               # progress intervals are fitted in groups of at least this many seconds
PRIOR_WEIGHT = 5.0           # how much the FLOP model counts against the batches (per unit of their spread)


@dataclass(frozen=True)
class Cost:
    """Seconds a row, a token and a token squared (a row of L tokens has L^2) cost; `fitted`: the
    batches seen so far differ enough in length to fit them, else it is the FLOP model's shape
    (cost per token 1 + attention_weight x L) scaled to the time they took."""
    per_row: float
    per_token: float
    per_sq: float
    fitted: bool
    since_s: float = 0.0           # seconds since the last progress: work done, not yet reported
    interval_s: float = 0.0        # the attempt's usual interval between progress points

    def of(self, rows: float, tokens: float, sq: float) -> float:
        return self.per_row * rows + self.per_token * tokens + self.per_sq * sq


@dataclass(frozen=True)
class Pace:
    """Seconds a unit of work (a token, or a sample for a run that reports no tokens) takes;
    `span_s`: how long the attempt's batches have been measured."""
    per_unit: float
    unit: str                      # tokens | samples
    span_s: float
    cost: Cost | None = None       # the fitted cost of the work, where the worker reports it

    @property
    def settled(self) -> bool:
        return self.span_s >= SETTLED_S


def pace(record: ShardRecord, host_now: float) -> Pace | None:
    """The current attempt's pace: work over time between the points where its counters moved,
    from the first batch's completion (what came before is loading and reading) over at most the
    last PACE_WINDOW_S. None until two batches have completed."""
    a = record.attempt
    if a is None:
        return None
    tokens = record.total_tokens is not None
    column = 2 if tokens else 1
    moved = a.moved[column]            # where the column moved, from the first completed batch on
    if len(moved) == 1:                # one batch: timed from the attempt's first point (rough: "~")
        moved = [(a.history[0][0], *(0,) * (len(moved[0]) - 1)), moved[0]]
    behind = moved[-1][0] - moved[0][0] if moved else 0.0   # how long the pace has been measured
    cut = host_now - PACE_WINDOW_S
    moved = list(itertools.takewhile(lambda p: p[0] >= cut, reversed(moved)))[::-1] \
        or list(itertools.islice(moved, max(len(moved) - 2, 0), None))
    if len(moved) < 2 or moved[-1][0] <= moved[0][0] or moved[-1][column] <= moved[0][column]:
        return None
    span = moved[-1][0] - moved[0][0]
    return Pace(span / (moved[-1][column] - moved[0][column]), "tokens" if tokens else "samples", behind,
                fit_cost(record, host_now))


def pace_eta(record: ShardRecord, p: Pace | None) -> float | None:
    """Seconds of work left for this shard at pace `p`."""
    if p is None:
        return None
    left = work_left(record)
    if p.cost is not None and left is not None:
        # The last report is `since_s` old and the work went on since; but never count down more
        # than an interval's worth while nothing is reported (a stall must not look like an end).
        return max(p.cost.of(*left) - min(p.cost.since_s, p.cost.interval_s), 0.0)
    if p.unit == "tokens":
        assert record.total_tokens is not None, "pace() measures tokens only for a record with its total_tokens"
        return p.per_unit * max(record.total_tokens - record.tokens, 0)
    return p.per_unit * max(record.total - record.done - record.skipped, 0) if record.total else None


def work_left(record: ShardRecord) -> tuple[float, float, float] | None:
    """(rows, tokens, tokens squared) the shard has left, where the worker reported its work's cost."""
    r = record
    if r.total_rows is None or r.total_tokens is None or r.total_sq_tokens is None:
        return None
    return (max(r.total_rows - r.done, 0), max(r.total_tokens - r.tokens, 0),
            max(r.total_sq_tokens - r.sq_tokens, 0))


def batches(record: ShardRecord) -> list[tuple[float, float, float, float, float]]:
    """The attempt's progress as (end time, seconds, rows, tokens, tokens squared) per interval
    between the points where its tokens moved, each timed from when the write it reports was
    counted (the worker's `counted_t`; a tick's own time for an older worker), from when its
    first batch began (the worker's `batches_from`; else the progress point before the first
    move). Empty for a record without the work's cost."""
    a = record.attempt
    if a is None or record.attention_weight is None and record.total_sq_tokens is None:
        return []
    h = [p for p in a.history if len(p) >= 5]
    first = next((i for i in range(1, len(h)) if h[i][2] != h[i - 1][2]), None)
    if first is None:
        return []
    begin = h[first - 1][:5]
    if a.batches_from is not None and a.batches_from <= counted_at(h[first]):
        begin = (a.batches_from, *begin[1:])      # the first batch timed from its start, not a tick
    points = [begin] + [(counted_at(h[i]), *h[i][1:5]) for i in range(first, len(h)) if h[i][2] != h[i - 1][2]]
    return [(b[0], b[0] - a_[0], b[1] - a_[1], b[2] - a_[2], b[4] - a_[4])
            for a_, b in zip(points, points[1:]) if b[0] > a_[0]]


def counted_at(point: tuple) -> float:
    """When a history point's counters were counted: the write's time where the worker sent it."""
    return point[5] if len(point) > 5 else point[0]


def grouped(intervals: list, seconds: float = GROUP_S) -> list:
    """Consecutive intervals merged until each group spans `seconds`: progress arrives at ticks,
    so one interval's time is off by up to a tick, a group's by the same over a longer span."""
    out, acc = [], None
    for iv in intervals:
        acc = iv if acc is None else (iv[0], *(x + y for x, y in zip(acc[1:], iv[1:])))
        if acc[1] >= seconds:
            out.append(acc)
            acc = None
    if acc is not None:
        if out and acc[1] < seconds / 2:
            last = out.pop()
            acc = (acc[0], *(x + y for x, y in zip(last[1:], acc[1:])))
        out.append(acc)
    return out


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """m x = v by Gaussian elimination with partial pivoting (None when singular)."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[pivot][c]) < 1e-12:
            return None
        a[c], a[pivot] = a[pivot], a[c]
        for r in range(n):
            if r != c:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c])]
    return [a[i][n] / a[i][i] for i in range(n)]


def nnls_toward(xs: Sequence[tuple[float, ...]], ys: list[float], prior: tuple[float, ...],
                weight: float) -> tuple[float, ...]:
    """Non-negative least squares of ys on xs, each row weighted by 1 / its prior cost (a batch's
    time varies in proportion to it), pulled toward `prior` in the directions the rows do not
    pin down (ridge of `weight` per unit of each feature's spread). Small: every subset of free
    coefficients is tried (three features, eight subsets), the best non-negative one kept."""
    k = len(prior)
    var = [max(sum(x * p for x, p in zip(row, prior)), 1e-12) for row in xs]
    scale = [sum(row[j] ** 2 / v for row, v in zip(xs, var)) or 1.0 for j in range(k)]
    ata = [[sum(row[i] * row[j] / v for row, v in zip(xs, var)) for j in range(k)] for i in range(k)]
    aty = [sum(row[i] * y / v for row, y, v in zip(xs, ys, var)) for i in range(k)]

    def loss(theta):
        fit = sum((y - sum(x * t for x, t in zip(row, theta))) ** 2 / v for row, y, v in zip(xs, ys, var))
        return fit + weight * sum(s * (t - p) ** 2 for s, t, p in zip(scale, theta, prior))

    best, best_loss = tuple(0.0 for _ in prior), None
    for n in range(k + 1):
        for free in itertools.combinations(range(k), n):
            theta = [0.0] * k
            if free:
                m = [[ata[i][j] + (weight * scale[i] if i == j else 0.0) for j in free] for i in free]
                v = [aty[i] + weight * scale[i] * prior[i] for i in free]
                x = _solve(m, v)
                if x is None or min(x) < 0:
                    continue
                for i, xi in zip(free, x):
                    theta[i] = xi
            value = loss(theta)
            if best_loss is None or value < best_loss:
                best, best_loss = tuple(theta), value
    return best


def fit_cost(record: ShardRecord, host_now: float) -> Cost | None:
    """The cost of the attempt's work, fitted to its batches: non-negative least squares of each
    group of intervals' seconds on its rows, tokens and tokens squared, the first batch (warm-up)
    and, after a restart, the first RESTART_SETTLE_S left out while later ones exist. Long rows
    come first, so early batches cannot tell a token's cost from its attention's: the fit leans
    on the worker's FLOP model (cost per token 1 + attention_weight x L), scaled to the time the
    batches took, until their lengths differ enough. None before a batch is measured."""
    a = record.attempt
    if a is None or not a.history:
        return None
    # Refit once per REFIT_S of progress after the first points (a fit over 600 points is ~3 ms:
    # 512 shards refitted at every progress event would cost a core), kept on the attempt.
    key = (len(a.history), 0) if len(a.history) < 40 else (-1, int(a.history[-1][0] // REFIT_S))
    cached = a.__dict__.get("_cost_fit")
    if cached is not None and cached[0] == key:
        cost = cached[1]
        return cost if cost is None else dataclasses.replace(cost, since_s=max(host_now - last_move(a), 0.0))
    cost = _fit_cost(record, host_now)
    a.__dict__["_cost_fit"] = (key, cost)
    return cost


def last_move(a) -> float:
    """When the attempt's tokens last moved (host clock)."""
    h = a.history
    for i in range(len(h) - 1, 0, -1):
        if h[i][2] != h[i - 1][2]:
            return counted_at(h[i])
    return h[0][0]


def _fit_cost(record: ShardRecord, host_now: float) -> Cost | None:
    intervals = batches(record)
    if not intervals:
        return None
    start = intervals[0][0] - intervals[0][1]
    kept = intervals[1:] or intervals
    if record.attempt is not None and record.attempt.n > 1:
        kept = [iv for iv in kept if iv[0] - start >= RESTART_SETTLE_S] or kept
    groups = grouped(kept)
    xs = [(g[2], g[3], g[4]) for g in groups]
    ys = [g[1] for g in groups]
    weight = record.attention_weight or 0.0
    shape = (0.0, 1.0, weight)
    work = sum(x[1] + weight * x[2] for x in xs)
    if work <= 0:
        return None
    prior = tuple(c * sum(ys) / work for c in shape)
    theta = nnls_toward(xs, ys, prior, PRIOR_WEIGHT) if len(xs) >= 2 else prior
    last = intervals[-1][0]
    gaps = [iv[1] for iv in intervals]
    per_row, per_token, per_sq = theta
    return Cost(per_row, per_token, per_sq, fitted=theta != prior, since_s=max(host_now - last, 0.0),
                interval_s=statistics.median(gaps))


@dataclass(frozen=True)
class Progress:
    age_s: float                  # since the attempt's last progress (or its launch), host clock
    usual_s: float | None         # its usual interval between progress events
    late: bool                    # age over LATE_FACTOR usual intervals: a stall in the making


def progress_age(record: ShardRecord, host_now: float, idle_s: float | None = None) -> Progress | None:
    """How long the live attempt has gone without progress (`idle_s`: as the host's monotonic
    clock measured it; else from the record's stamps), against its own usual interval."""
    a = record.attempt
    if a is None or a.ended:
        return None
    age = idle_s if idle_s is not None else max(host_now - a.last_progress_t, 0.0)
    # Gaps within what a replay keeps in full (worker.agent.thin_progress), so a re-attached
    # supervisor judges LATE as the live one did.
    # Only the last few points are read: the judge asks this of every live shard at every pass.
    last = [p[0] for p in itertools.islice(reversed(a.history), USUAL_OF + 1)][::-1]
    recent = [t for t in last if t >= last[-1] - protocol.REPLAY_RECENT_S]
    gaps = [b - x for x, b in zip(recent, recent[1:]) if b > x]
    usual = statistics.median(gaps) if len(gaps) >= 2 else None
    late = usual is not None and age > max(LATE_FACTOR * usual, LATE_MIN_S)
    return Progress(age, usual, late)
