"""What bounds a host: its GPUs, its disk or its upload, and the share of the time its GPUs waited.

The worker counts, per launch, the seconds its forward waited for a free host buffer (`writer_wait_s`:
the writer was behind) and, of the writer's time, the seconds it waited for room under keep_local
(`ship_wait_s`: the shipper was behind). A shard's record keeps those counters as they came
(fleet/record.py); here they become, over a span of batch time,

    the share the GPU waited = Δwriter_wait / Δt
    of that wait, shipping's  = Δship_wait / Δwriter_wait (at most all of it)

and a verdict: a GPU that waited under WAIT_FLOOR of the time is what sets the pace; above it, the
upload when shipping held the writer for most of the wait, else the disk (the writer writing). A host
and the run add their shards' spans (seconds of GPU time, seconds waited) — the last WINDOW_S of each
running shard while the run goes, every batch of every launch once it is over. Pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from .schema import Bound

WINDOW_S = 60.0        # the live verdict: each running shard's last minute of batches
MIN_SPAN_S = 5.0       # less batch time than this says nothing yet
WAIT_FLOOR = 0.05      # a GPU waiting under 5% of the time is the bound itself

Point = tuple[float, float, float]     # (time, writer_wait_s, ship_wait_s) as a progress event said them


@dataclass(frozen=True)
class Wait:
    """Seconds of batch time on a GPU, of them waited for the writer, and of those for shipping."""
    seconds: float = 0.0
    gpu: float = 0.0
    ship: float = 0.0

    def __add__(self, other: Wait) -> Wait:
        return Wait(self.seconds + other.seconds, self.gpu + other.gpu, self.ship + other.ship)


def span(first: Point, last: Point) -> Wait:
    """The wait between two points of one launch (its counters only grow; a wait is never longer
    than the time it fell in)."""
    seconds = max(last[0] - first[0], 0.0)
    gpu = min(max(last[1] - first[1], 0.0), seconds)
    return Wait(seconds, gpu, min(max(last[2] - first[2], 0.0), gpu))


def recent(points: Sequence[Point], window_s: float = WINDOW_S) -> Wait:
    """The last `window_s` of a launch's points (from the newest point back to the oldest one within
    the window, or the one just before it when none is)."""
    if len(points) < 2:
        return Wait()
    last = points[-1]
    for k in range(len(points) - 2, -1, -1):        # (a deque: indexed, not sliced)
        if points[k][0] <= last[0] - window_s or k == 0:
            return span(points[k], last)
    return Wait()


def whole(batches_from: float | None, points: Sequence[Point]) -> Wait:
    """A launch's every batch: from its first batch's start (counters at zero) to its newest point."""
    if not points:
        return Wait()
    start = (batches_from, 0.0, 0.0) if batches_from is not None and batches_from <= points[0][0] else points[0]
    return span(start, points[-1])


def verdict(waits: Iterable[Wait]) -> Bound | None:
    """The bound of the spans together, or None while they hold too little batch time to say."""
    total = sum(waits, Wait())
    if total.seconds < MIN_SPAN_S:
        return None
    share = total.gpu / total.seconds
    by = "gpu" if share < WAIT_FLOOR else ("upload" if total.ship * 2 >= total.gpu else "disk")
    return Bound(by=by, gpu_waited=round(share, 3), seconds=round(total.seconds, 1))
