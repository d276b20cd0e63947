"""Waiting in the live view's tests on what the app shows, never on the clock: a fixed pause is
too short on a loaded CI machine and wasted on a quiet one (the flaky family of issue 37)."""

from __future__ import annotations

import time

POLL_S = 0.02                    # the app runs (its timers, workers, messages) between looks


async def until(pilot, predicate, timeout: float = 120, what: str = "condition") -> None:
    """Return as soon as predicate() holds, letting the app run between looks; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(POLL_S)


async def drawn(pilot, app, timeout: float = 60) -> None:
    """The main screen has drawn a snapshot (its first, at mount), the chart's past is in (a worker
    asks the source for it) where the run's hosts are read, and it is idle."""
    from fleet.tui.panes.throughput import ThroughputChart
    await until(pilot, lambda: app.screen_stack and app.snap is not None, timeout, "the first snapshot drawn")

    def charted() -> bool:
        charts = app.main.query(ThroughputChart)
        return not app.snap.totals.replayed or not charts or charts.first().rebuilt
    await until(pilot, charted, timeout, "the chart's past rebuilt")
    await pilot.pause()


async def redrawn(pilot, app, timeout: float = 60) -> None:
    """A Refresh: the newest snapshot drawn (another object than the one shown now)."""
    from fleet.tui.app import Refresh
    before = app.snap
    app.post_message(Refresh())
    await until(pilot, lambda: app.snap is not before, timeout, "a new snapshot drawn")
    await pilot.pause()
