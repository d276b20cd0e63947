"""fleet/bound.py: what bounds a host, from the workers' cumulative counts of their waits.

Invariants, over any launch's progress points (counters that only grow, sampled at any times):
- a launch's whole wait is its batches' time and the sum of what it waited in each interval,
  summed here interval by interval (independently of the counters' first and last values);
- the recent wait covers at least the window (or the whole launch when shorter) and no more
  than one interval beyond it;
- the verdict depends only on the sums: shards added one by one or all at once say the same, and
  the GPU is the bound exactly when it waited under the floor.
"""

from __future__ import annotations

import math
from collections import deque

from hypothesis import given
from hypothesis import strategies as st

from fleet.bound import MIN_SPAN_S, WAIT_FLOOR, WINDOW_S, Wait, recent, verdict, whole

# One interval between progress points: its seconds, the share of them the GPU waited, and the
# share of that wait the writer spent waiting for shipping.
interval = st.tuples(st.floats(0.1, 20), st.floats(0, 1), st.floats(0, 1))


def points_of(start: float, intervals) -> deque:
    """The points a record holds (a deque, as fleet/record.py keeps them)."""
    t, gpu, ship = start, 0.0, 0.0
    out = deque([(t, gpu, ship)])
    for dt, g, s in intervals:
        t, gpu, ship = t + dt, gpu + dt * g, ship + dt * g * s
        out.append((t, gpu, ship))
    return out


@given(st.floats(0, 1e6), st.lists(interval, min_size=1, max_size=40))
def test_a_launchs_whole_wait_is_the_sum_of_its_intervals(start, intervals):
    points = points_of(start, intervals)
    points.popleft()                                      # the first point is the first batch's start
    w = whole(start, points)
    assert math.isclose(w.seconds, sum(dt for dt, _, _ in intervals), rel_tol=1e-9, abs_tol=1e-6)
    assert math.isclose(w.gpu, sum(dt * g for dt, g, _ in intervals), rel_tol=1e-9, abs_tol=1e-6)
    assert math.isclose(w.ship, sum(dt * g * s for dt, g, s in intervals), rel_tol=1e-9, abs_tol=1e-6)
    assert 0 <= w.ship <= w.gpu + 1e-9 <= w.seconds + 2e-9


@given(st.lists(interval, min_size=1, max_size=60), st.floats(1, 120))
def test_the_recent_wait_covers_the_window_and_at_most_one_interval_more(intervals, window):
    points = points_of(0.0, intervals)
    w = recent(points, window)
    total = points[-1][0]
    longest = max(dt for dt, _, _ in intervals)
    assert w.seconds >= min(window, total) - 1e-6
    assert w.seconds <= window + longest + 1e-6
    assert w.gpu <= w.seconds + 1e-9 and w.ship <= w.gpu + 1e-9


@given(st.lists(st.tuples(st.floats(0, 600), st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=12))
def test_the_verdict_rests_on_the_sums_alone(shards):
    waits = [Wait(s, s * g, s * g * x) for s, g, x in shards]
    together = verdict(waits)
    summed = Wait()
    for w in waits:
        summed = summed + w
    assert together == verdict([summed])
    seconds = sum(s for s, _, _ in shards)
    if seconds < MIN_SPAN_S:
        assert together is None
        return
    assert together is not None
    waited = sum(s * g for s, g, _ in shards) / seconds
    assert (together.by == "gpu") == (waited < WAIT_FLOOR) or math.isclose(waited, WAIT_FLOOR, rel_tol=1e-6)
    if together.by != "gpu":
        ship = sum(s * g * x for s, g, x in shards)
        assert (together.by == "upload") == (2 * ship >= waited * seconds) or \
            math.isclose(2 * ship, waited * seconds, rel_tol=1e-6)


def test_the_live_window_is_a_minute_and_a_verdict_needs_seconds_of_batches():
    assert (WINDOW_S, MIN_SPAN_S, WAIT_FLOOR) == (60.0, 5.0, 0.05)
    assert verdict([Wait(4.9, 4.9, 0.0)]) is None
    b = verdict([Wait(100, 30, 20)])
    assert b is not None and (b.by, b.gpu_waited, b.text) == ("upload", 0.3, "bound by upload: GPUs waited 30%")
    b = verdict([Wait(100, 30, 10)])
    assert b is not None and (b.by, b.text) == ("disk", "bound by disk: GPUs waited 30%")
    b = verdict([Wait(100, 1, 1)])
    assert b is not None and b.text == "bound by GPU: GPUs waited 1%"
