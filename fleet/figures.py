"""Small pure figures of one shard's attempt, each readable and tested alone: how long its work
will take (a pace fitted over minutes, not the last window's rate) and how late its progress is.

Why not tokens/s over the last 30 s for the ETA: progress arrives a batch at a time and rows come
longest first, so a 30 s window of it swings the ETA by minutes within seconds. The pace is work
over time between the points where the counters moved, from the first completed batch (loading and
reading the rows are left out) over the last 2 minutes. Until it has 3 minutes behind it the ETA
says it is rough ("~"). It still assumes the pace holds: where the per-token cost falls as rows get
shorter (attention-bound models on a CPU) the ETA runs long; docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .record import ShardRecord

PACE_WINDOW_S = 120.0        # the pace looks back this far at most (it drifts as rows get shorter)
SETTLED_S = 180.0            # a fit over this much progress is shown as it is, else as "~"
LATE_FACTOR = 3.0            # progress later than this many usual intervals is shown amber
LATE_MIN_S = 10.0            # ...and never for less than this


@dataclass(frozen=True)
class Pace:
    """Seconds a unit of work (a token, or a sample for a run that reports no tokens) takes;
    `span_s`: how long the attempt's batches have been measured."""
    per_unit: float
    unit: str                      # tokens | samples
    span_s: float

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
    moved = [p for i, p in enumerate(a.history) if i == 0 or p[column] != a.history[i - 1][column]]
    moved = [p for p in moved if p[column] > 0]             # from the first completed batch on
    if len(moved) == 1:                # one batch: timed from the attempt's first point (rough: "~")
        moved = [(a.history[0][0], *(0,) * (len(moved[0]) - 1)), moved[0]]
    behind = moved[-1][0] - moved[0][0] if moved else 0.0   # how long the pace has been measured
    moved = [p for p in moved if p[0] >= host_now - PACE_WINDOW_S] or moved[-2:]
    if len(moved) < 2 or moved[-1][0] <= moved[0][0] or moved[-1][column] <= moved[0][column]:
        return None
    span = moved[-1][0] - moved[0][0]
    return Pace(span / (moved[-1][column] - moved[0][column]), "tokens" if tokens else "samples", behind)


def pace_eta(record: ShardRecord, p: Pace | None) -> float | None:
    """Seconds of work left for this shard at pace `p`."""
    if p is None:
        return None
    if p.unit == "tokens":
        return p.per_unit * max(record.total_tokens - record.tokens, 0)
    return p.per_unit * max(record.total - record.done - record.skipped, 0) if record.total else None


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
    times = [p[0] for p in a.history]
    gaps = [b - x for x, b in zip(times, times[1:]) if b > x]
    usual = statistics.median(gaps) if len(gaps) >= 2 else None
    late = usual is not None and age > max(LATE_FACTOR * usual, LATE_MIN_S)
    return Progress(age, usual, late)
