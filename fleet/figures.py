"""Small pure figures of one shard's attempt, each readable and tested alone: how long its work
will take (a pace fitted over minutes, not the last window's rate) and how late its progress is.

Why not tokens/s over the last 30 s for the ETA: rows come longest first, so a shard's tokens/s
drifts several-fold over a run (a 7.6x drift was measured on the demo) and a window of it swings
the ETA by minutes within seconds. The time a batch takes is close to a per-sample cost plus a
per-token cost; both are fitted by least squares over the attempt's progress since its warm-up
(the first minute after a launch, or the first quarter of a shorter attempt, is left out) and the
work left is priced with them. Until the fit has minutes behind it, the ETA says it is rough.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .record import ShardRecord

WARMUP_S = 60.0              # left out after a launch: loading, kernel tuning, the first batches
PACE_WINDOW_S = 900.0        # the fit looks back this far at most (the pace changes over a run)
SETTLED_S = 180.0            # a fit over this much progress is shown as it is, else as "~"
LATE_FACTOR = 3.0            # progress later than this many usual intervals is shown amber
LATE_MIN_S = 10.0            # ...and never for less than this


@dataclass(frozen=True)
class Pace:
    """Seconds a sample costs and seconds a token costs, over `span_s` of progress."""
    per_sample: float
    per_token: float
    span_s: float

    @property
    def settled(self) -> bool:
        return self.span_s >= SETTLED_S

    def seconds(self, samples: float, tokens: float) -> float:
        return self.per_sample * samples + self.per_token * tokens


def pace(record: ShardRecord, host_now: float) -> Pace | None:
    """The current attempt's pace over its progress since warm-up (None: not enough of it yet)."""
    a = record.attempt
    if a is None or len(a.history) < 3:
        return None
    first = a.history[0][0]
    start = max(first + min(WARMUP_S, 0.25 * (host_now - first)), host_now - PACE_WINDOW_S)
    points = [p for p in a.history if p[0] >= start]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    steps = [(b[0] - x[0], b[1] - x[1], b[2] - x[2]) for x, b in zip(points, points[1:]) if b[0] > x[0]]
    return fit(steps, points[-1][0] - points[0][0], use_tokens=record.total_tokens is not None)


def fit(steps: list[tuple[float, float, float]], span: float, use_tokens: bool) -> Pace | None:
    """Least squares of dt = a*samples + b*tokens over the steps, both costs >= 0 (a cost that
    comes out negative is dropped and the other fitted alone)."""
    dt = sum(s[0] for s in steps)
    ds = sum(s[1] for s in steps)
    dk = sum(s[2] for s in steps)
    if dt <= 0 or (ds <= 0 and dk <= 0):
        return None
    if not use_tokens or dk <= 0:
        return Pace(dt / ds, 0.0, span) if ds > 0 else None
    ss = sum(s[1] * s[1] for s in steps)
    kk = sum(s[2] * s[2] for s in steps)
    sk = sum(s[1] * s[2] for s in steps)
    ts = sum(s[0] * s[1] for s in steps)
    tk = sum(s[0] * s[2] for s in steps)
    det = ss * kk - sk * sk
    if det > 1e-12 * ss * kk:
        a, b = (ts * kk - tk * sk) / det, (tk * ss - ts * sk) / det
        if a >= 0 and b >= 0:
            return Pace(a, b, span)
    return Pace(0.0, dt / dk, span)                # tokens alone (the common case on a GPU)


def pace_eta(record: ShardRecord, p: Pace | None) -> float | None:
    """Seconds of work left for this shard at pace `p`."""
    if p is None or not record.total:
        return None
    samples_left = max(record.total - record.done - record.skipped, 0)
    tokens_left = max(record.total_tokens - record.tokens, 0) if record.total_tokens is not None else 0
    return p.seconds(samples_left, tokens_left)


@dataclass(frozen=True)
class Progress:
    age_s: float                  # since the attempt's last progress (or its launch), host clock
    usual_s: float | None         # its usual interval between progress events
    late: bool                    # age over LATE_FACTOR usual intervals: a stall in the making


def progress_age(record: ShardRecord, host_now: float) -> Progress | None:
    """How long the live attempt has gone without progress, against its own usual interval."""
    a = record.attempt
    if a is None or a.ended:
        return None
    age = max(host_now - a.last_progress_t, 0.0)
    times = [p[0] for p in a.history]
    gaps = [b - x for x, b in zip(times, times[1:]) if b > x]
    usual = statistics.median(gaps) if len(gaps) >= 2 else None
    late = usual is not None and age > max(LATE_FACTOR * usual, LATE_MIN_S)
    return Progress(age, usual, late)
