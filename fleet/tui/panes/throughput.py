"""Throughput over time: aggregate samples/s as a sparkline, against the expected figure."""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

HISTORY = 240                     # points kept (capped: memory stays flat over a long run)


class ThroughputPane(Vertical):
    DEFAULT_CSS = """
    ThroughputPane { height: 5; }
    ThroughputPane Sparkline { height: 3; }
    ThroughputPane #tp-label { height: 1; }
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.history: deque[float] = deque(maxlen=HISTORY)

    def compose(self) -> ComposeResult:
        yield Static("throughput: not measured yet", id="tp-label")
        yield Sparkline([], summary_function=max, id="tp-spark")

    def add(self, snap) -> None:
        t = snap.totals
        value = t.samples_per_s
        if value is None:
            return
        self.history.append(value)
        expected = t.expected_per_s
        unit = t.expected_unit or "samples"
        exp = f", expected {expected:,.1f} {unit}/s" if expected else ""
        peak = max(self.history)
        self.query_one("#tp-label", Static).update(
            f"throughput (samples/s, last {len(self.history)} readings): now {value:,.1f}, peak {peak:,.1f}{exp}")
        self.query_one("#tp-spark", Sparkline).data = list(self.history)
