"""Throughput over time, a chart with axes: the fleet's tokens/s (samples/s for a [job] that
reports no tokens) per column of 1 to 60 s (the finest that shows all that is kept), the value
axis on the left from a zero baseline, a time axis under it, and the expected rate as a dotted line.

On attach the past is rebuilt from the records (`source.history()`, computed by
`fleet.judge.throughput_history`), so a re-attached view starts with the run's curve, not a blank;
from then on each redraw adds the snapshot's figure. Points are capped to an hour.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from ...schema import FleetSnapshot
from ...units import ago, duration, si

BUCKET_S = 10.0                      # one column of the chart
HISTORY_S = 3600.0                   # what is kept
MARGIN = 7                           # the value axis labels
_BLOCKS = " ▁▂▃▄▅▆▇█"


def nice_top(x: float) -> float:
    """A round value at or above x for the top of the axis (1, 2, 2.5, 5 x 10^n)."""
    if x <= 0:
        return 1.0
    import math
    exp = 10 ** math.floor(math.log10(x))
    for m in (1, 2, 2.5, 5, 10):
        if m * exp >= x:
            return m * exp
    return 10 * exp


# Seconds a column can stand for: steps at most 4/3 apart, so the axis is at most a third longer
# than the run (a 39 s run showed a 30-minute axis: the rebuilt past was a fixed number of 10 s
# intervals, and the coarse steps 1, 2, 5, 10… could double the axis).
BUCKETS_S = (0.25, 0.3, 0.4, 0.5, 0.6, 0.75, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 40, 50, 60)
CARRY_S = 10.0                           # a gap this short between readings is drawn at the last one


def bucket_for(points, now: float, width: int, start: float | None = None) -> float:
    """The finest column width that shows the whole run (from `start`, its first launch, where
    known; else the first point kept) in `width` columns: a 40 s run fills the chart too."""
    first = points[0][0] if points else now
    span = now - (max(first, start) if start is not None else first)
    return next((float(b) for b in BUCKETS_S if b * width >= span), float(BUCKETS_S[-1]))


def columns(points, now: float, width: int, bucket: float = BUCKET_S) -> list[float | None]:
    """The mean value in each of `width` buckets ending at `now` (None where nothing was seen;
    a column between two readings less than CARRY_S apart shows the earlier one)."""
    sums = [0.0] * width
    counts = [0] * width
    start = now - width * bucket
    for t, v in points:
        if t <= start or t > now + bucket:
            continue
        i = min(int((t - start) / bucket), width - 1)
        sums[i] += v
        counts[i] += 1
    out = [sums[i] / counts[i] if counts[i] else None for i in range(width)]
    seen = [i for i in range(width) if counts[i]]
    for a, b in zip(seen, seen[1:]):
        if (b - a) * bucket <= CARRY_S:
            out[a + 1:b] = [out[a]] * (b - a - 1)
    return out


class ThroughputChart(Widget):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.points: deque[tuple[float, float]] = deque()
        self.unit = "tokens"
        self.expected: float | None = None
        self.now = 0.0
        self.start: float | None = None      # the run's start (now - elapsed), for the axis
        self.title = "throughput: waiting for the first reading"
        self.rebuilt = False
        self._lines: list[Strip] | None = None

    def fill(self, history: list[tuple[float, float, float]], unit: str) -> None:
        """The past, rebuilt from the records: (time, tokens/s, samples/s)."""
        self.rebuilt = True
        first = self.points[0][0] if self.points else float("inf")    # (readings added meanwhile)
        self.points.extendleft(reversed([(t, tok if unit == "tokens" else smp) for t, tok, smp in history
                                         if t <= first]))
        self._lines = None

    def add(self, snap: FleetSnapshot) -> None:
        t = snap.totals
        self.unit = "tokens" if t.tokens or t.total_tokens else "samples"
        value = t.tokens_per_s if self.unit == "tokens" else t.samples_per_s
        # A settled run's chart stops at its end instead of sliding out of view.
        self.now = self.points[-1][0] if t.settled and self.points else snap.time
        self.start = self.now - t.elapsed_s if t.elapsed_s else None
        if t.replayed and not t.settled:
            self.points.append((snap.time, value or 0.0))
        while self.points and self.points[0][0] < snap.time - HISTORY_S:
            self.points.popleft()
        self.expected = t.expected_tokens_per_s if self.unit == "tokens" else (
            t.expected_per_s if t.expected_unit == "samples" else None)
        label = "tok/s" if self.unit == "tokens" else "samples/s"
        if t.finished or t.settled:
            avg = t.avg_tokens_per_s if self.unit == "tokens" else t.avg_samples_per_s
            per_gpu = f" ({si(t.avg_tokens_per_s_per_gpu)}/GPU)" if self.unit == "tokens" and \
                t.avg_tokens_per_s_per_gpu is not None else ""
            self.title = f"throughput {label}: run average {si(avg)}{per_gpu} over {duration(t.elapsed_s)}"
        else:
            now = si(value) if value is not None else "not measured"
            exp = f" · expected {si(self.expected)} ┈" if self.expected else ""
            secondary = f" · {t.samples_per_s:,.1f} samples/s" if self.unit == "tokens" and \
                t.samples_per_s is not None else ""
            self.title = f"throughput {label}: now {now}{secondary}{exp}"
        self._lines = None
        self.refresh()

    def on_resize(self) -> None:
        self._lines = None

    def render_line(self, y: int) -> Strip:
        if self._lines is None or len(self._lines) != self.size.height:
            self._lines = self._draw(self.size.width, self.size.height)
        return self._lines[y] if y < len(self._lines) else Strip.blank(self.size.width)

    def _draw(self, width: int, height: int) -> list[Strip]:
        """The title, `height - 3` rows of bars against the value axis, the zero baseline with its
        ticks and the time labels under it; the title alone when the chart has no room."""
        styles = self._styles()
        base, axis = styles.base, styles.axis
        lines = [Strip([Segment(self.title[:width].ljust(width), base + Style(bold=True))])]
        rows = height - 3
        plot = width - MARGIN - 1
        if rows < 1 or plot < 10:
            return (lines + [Strip.blank(width, base)] * height)[:height]
        bucket = bucket_for(self.points, self.now, plot, self.start)
        values = columns(self.points, self.now, plot, bucket)
        lines += self._bar_rows(values, rows, width, styles)
        ticks = time_ticks(plot, bucket)
        baseline = "".join("┴" if x in ticks else "─" for x in range(plot))
        lines.append(Strip([Segment("0".rjust(MARGIN - 1) + " └", axis), Segment(baseline, axis)])
                     .adjust_cell_length(width, base))
        lines.append(Strip([Segment(" " * (MARGIN + 1) + tick_labels(ticks, plot), axis)])
                     .adjust_cell_length(width, base))
        return lines[:height]

    def _styles(self) -> ChartStyles:
        """The chart's styles over the widget's own; NO_COLOR marks the expected line by weight."""
        base = self.rich_style
        return ChartStyles(base=base, axis=base + Style(dim=True),
                           bars=base + Style(color="green") if not self.app.no_color else base,
                           expected=base + (Style(color="yellow") if not self.app.no_color else Style(bold=True)))

    def _bar_rows(self, values: list[float | None], rows: int, width: int, styles: ChartStyles) -> list[Strip]:
        """The plot's rows from the top: a value label at the top and the middle, then each
        column's bar to the eighth of a row, under a round top a little above the highest value."""
        seen = [v for v in values if v is not None]
        top = nice_top(max(seen + ([self.expected] if self.expected else []) + [1e-9]) * 1.05)
        exp_row = None
        if self.expected:
            exp_row = rows - 1 - min(int(self.expected / top * rows), rows - 1)
        out = []
        for r in range(rows):
            label = si(top * (rows - r) / rows) if r == 0 or (rows >= 4 and r == rows // 2) else ""
            segments = [Segment(label.rjust(MARGIN - 1)[: MARGIN - 1] + " ", styles.axis),
                        Segment("┤" if label else "│", styles.axis)]
            segments += row_cells(values, top, rows, r, r == exp_row, styles)
            out.append(Strip(segments).adjust_cell_length(width, styles.base))
        return out


class ChartStyles(NamedTuple):
    base: Style
    axis: Style
    bars: Style
    expected: Style


def row_cells(values: list[float | None], top: float, rows: int, r: int, expected_row: bool,
              styles: ChartStyles) -> list[Segment]:
    """Row `r`'s cells (0 at the top): a column's bar filled to its eighth of the row, else the
    expected rate's dot where this is its row, else blank."""
    level_lo = (rows - 1 - r) * 8              # eighths below this row
    cells = []
    for v in values:
        e = 0 if v is None else int(round(v / top * rows * 8))
        fill = min(max(e - level_lo, 0), 8)
        if fill:
            cells.append(Segment("█" if fill == 8 else _BLOCKS[fill], styles.bars))
        elif expected_row:
            cells.append(Segment("┈", styles.expected))
        else:
            cells.append(Segment(" ", styles.base))
    return cells


def time_ticks(plot: int, bucket: float) -> dict[int, str]:
    """The columns of the time axis that get a tick, each with how long ago it is: at most about
    six, a round step apart, counted back from now at the right edge."""
    ticks = {}
    span = plot * bucket
    step = next((s for s in (5, 10, 15, 20, 30, 60, 120, 300, 600, 900, 1800, 3600) if span / s <= 6), 3600)
    for k in range(0, int(span // step) + 1):
        x = plot - 1 - int(k * step / bucket)
        if x >= 0:
            ticks[x] = ago(k * step)
    return ticks


def tick_labels(ticks: dict[int, str], plot: int) -> str:
    """The time labels under the ticks, left to right, each centred on its tick ('now' ends at
    it), inside the plot; a label that would touch the one before it is left out."""
    labels = [" "] * plot
    for x, text in sorted(ticks.items()):
        start = min(max(x - len(text) + 1 if text == "now" else x - len(text) // 2, 0), plot - len(text))
        if all(c == " " for c in labels[max(start - 1, 0):start + len(text) + 1]):
            labels[start:start + len(text)] = list(text)
    return "".join(labels)
