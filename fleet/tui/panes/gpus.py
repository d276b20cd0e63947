"""GPUs pane, nvitop-like: per GPU a memory bar and a utilisation bar with thresholds, a short
utilisation history, temperature and power coloured, GiB as nvidia-smi reads them; the selected
shard's GPU highlighted. A fleet of many hosts shows one summary row per host, which `enter` (or a
click) expands to its GPUs. No telemetry at all: the pane is one line that says so. An unreachable
host is UNKNOWN, never zeros.

The history is what this view has watched (a few dozen readings per GPU, capped); everything
else comes from the snapshot.
"""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Static

from ...schema import FleetSnapshot, HostStatus
from ...units import gib, usd
from ..style import (bar, level_style, memory_level, power_level, spark, temp_level,
                     util_level, wait_level)
from .lines import Column, LineTable, Rest, show_text

HISTORY = 60                   # utilisation readings kept per GPU (about 90 s at the 1.5 s redraw)
EXPAND_ALL_UP_TO = 24          # hosts + GPUs: below this every host starts expanded

COLUMNS = [
    Column("name", "host / gpu", 12, 0),
    Column("mem", "memory GiB", 17, 1),
    Column("util", "util", 10, 2),
    Column("hist", "history", 10, 6),
    Column("temp", "temp", 4, 3, "right"),
    Column("power", "power", 6, 4, "right"),
    Column("cost", "$/h  spent", 13, 5, "right"),
    Column("bound", "bound by", 11, 4),
    Column("age", "reading", 8, 7),
]


def _num(v, unit: str) -> str:
    return "—" if v is None else f"{v:.0f}{unit}"


def _styled(text: str, level: str, no_color: bool) -> tuple:
    return ((text, level_style(level, no_color) or None),)


def meter(fraction: float | None, width: int, label: str, level: str, no_color: bool) -> tuple:
    if fraction is None:
        return (("—", None),)
    return ((bar(fraction, width), level_style(level, no_color) or None), (" " + label, None))


def bound_cell(h: HostStatus, no_color: bool) -> tuple | str:
    """'GPU', or what its GPUs wait for and for how much of the time: 'disk 23%', 'upload 41%'."""
    b = h.bound
    if b is None:
        return ""
    if b.by == "gpu":
        return b.label
    return _styled(f"{b.label} {b.gpu_waited:.0%}", wait_level(b.gpu_waited), no_color)


def cost_cell(h: HostStatus) -> str:
    if h.usd_per_hour is None:
        return ""
    return f"{usd(h.usd_per_hour)}/h {usd(h.usd_spent)}"


class GpuTable(LineTable):
    BINDINGS = [Binding("enter", "toggle_host", "expand host", tooltip="expand or fold the selected host's GPUs")]

    def __init__(self, **kw):
        super().__init__(COLUMNS, **kw)
        self.expanded: set[str] = set()
        self.folded: set[str] = set()
        self.history: dict[str, deque] = {}
        self._hosts: dict[str, HostStatus] = {}

    def is_expanded(self, host: str, rows_if_all: int) -> bool:
        if host in self.expanded:
            return True
        return rows_if_all <= EXPAND_ALL_UP_TO and host not in self.folded

    def observe(self, snap: FleetSnapshot) -> None:
        """A new snapshot: add each GPU's utilisation to its history (a redraw adds nothing)."""
        for h in snap.hosts:
            for g in h.gpus or []:
                if g.util is not None and h.gpu_age_s is not None:
                    self.history.setdefault(f"g:{h.name}:{g.index}", deque(maxlen=HISTORY)).append(g.util)

    def show(self, snap: FleetSnapshot, selected: tuple[str, tuple[int, ...]] | None,
             no_color: bool = False) -> None:
        """`selected`: the selected shard's host and GPUs (several for a multi-GPU shard)."""
        keys: list[str] = []
        rows: dict[str, tuple] = {}
        highlight: set[str] = set()
        rows_if_all = sum(1 + len(h.gpus or []) for h in snap.hosts)
        self._hosts = {h.name: h for h in snap.hosts}
        for h in snap.hosts:
            hkey = f"h:{h.name}"
            keys.append(hkey)
            open_ = self.is_expanded(h.name, rows_if_all) and bool(h.gpus)
            rows[hkey] = (h, None, open_)
            if selected and selected[0] == h.name and not open_:
                highlight.add(hkey)
            if not open_:
                continue
            for g in h.gpus or []:
                gkey = f"g:{h.name}:{g.index}"
                keys.append(gkey)
                rows[gkey] = (h, g, open_)
                if selected and selected[0] == h.name and g.index in selected[1]:
                    highlight.add(gkey)

        def make(key: str) -> tuple:
            h, g, open_ = rows[key]
            if g is None:
                return self.host_cells(h, open_, no_color)
            return self.gpu_cells(h, g, self.history.get(key, ()), no_color)
        self.set_rows(keys, make, highlight)

    def host_cells(self, h: HostStatus, open_: bool, no_color: bool) -> tuple:
        arrow = "▾" if open_ else "▸"
        if h.reachable is False:                    # its reason takes the row: one column cut it at any width
            seen = f" · last seen {_num(h.last_seen_age_s, 's ago')}" if h.last_seen_age_s is not None else ""
            return (f"{arrow} {h.name}", Rest(((f"? UNKNOWN: {'unusable' if h.unusable else 'unreachable'}",
                                                "bold" if no_color else "#e070e0"),
                                               (f"{seen} · {h.error or 'no answer'}", None))))
        if h.reachable is None:
            return (f"{arrow} {h.name}", (("connecting…", "italic"),), "", "", "", "", cost_cell(h), "", "")
        t = h.gpu_totals
        if t is None:
            return (f"{arrow} {h.name}", (("no GPU telemetry", "italic"),), "", "", "", "", cost_cell(h),
                    bound_cell(h, no_color), "")
        frac = t.mem_used / t.mem_total if t.mem_total else None
        keys = [f"g:{h.name}:{g.index}" for g in h.gpus or [] if not g.lost]
        hist = [sum(x) / len(x) for x in zip(*(self.history.get(key, ()) for key in keys))]
        return (f"{arrow} {h.name} {t.count}×",
                meter(frac, 6, f"{gib(t.mem_used, 0)}/{gib(t.mem_total, 0)}", memory_level(frac or 0), no_color),
                meter(t.util / 100 if t.util is not None else None, 4, _num(t.util, "%"), util_level(t.util or 0),
                      no_color),
                spark(hist, 10, 100),
                _styled(_num(t.temp_max, "°"), temp_level(t.temp_max), no_color) if t.temp_max is not None else "—",
                f"{t.power_w / 1000:.1f}kW" if t.power_w >= 1000 else _num(t.power_w, "W"),
                cost_cell(h), bound_cell(h, no_color), self.age(h) if not t.lost else (("GPU lost", "bold red"),))

    def gpu_cells(self, h: HostStatus, g, hist, no_color: bool) -> tuple:
        name = f"  {g.index} {(g.name or '').removeprefix('NVIDIA ')}"
        if g.lost:
            return (name, (("GPU is lost", "bold" if no_color else "bold red"),), "", "", "", "", "", "", self.age(h))
        frac = g.mem_used / g.mem_total if g.mem_used is not None and g.mem_total else None
        return (name,
                meter(frac, 6, f"{gib(g.mem_used)}/{gib(g.mem_total)}", memory_level(frac or 0), no_color),
                meter(g.util / 100 if g.util is not None else None, 4, _num(g.util, "%"),
                      util_level(g.util or 0), no_color),
                spark(hist, 10, 100),
                _styled(_num(g.temp, "°"), temp_level(g.temp), no_color) if g.temp is not None else "—",
                _styled(_num(g.power_w, "W"), power_level(g.power_w, g.power_limit_w), no_color)
                if g.power_w is not None else "—",
                "", "", self.age(h))

    @staticmethod
    def age(h: HostStatus):
        if h.gpu_age_s is not None and h.gpu_age_s > 3:
            return ((f"stale {h.gpu_age_s:.0f}s", "yellow"),)
        return "live"

    def action_toggle_host(self) -> None:
        key = self.selected_key or ""
        host = key.split(":")[1] if ":" in key else None
        if host is None:
            return
        rows_if_all = sum(1 + len(h.gpus or []) for h in self._hosts.values())
        if self.is_expanded(host, rows_if_all):
            self.expanded.discard(host)
            self.folded.add(host)
            self.move_to_key(f"h:{host}")
        else:
            self.folded.discard(host)
            self.expanded.add(host)
        self.post_message(self.Toggled())

    class Toggled(Message):
        """A host was expanded or folded: the rows change."""

    def on_line_table_row_activated(self, event: LineTable.RowActivated) -> None:
        event.stop()
        self.action_toggle_host()


def telemetry_line(snap: FleetSnapshot) -> str | None:
    """One line for the pane when no host reports a GPU (a CPU run, no NVML and no nvidia-smi)."""
    if any(h.gpus for h in snap.hosts):
        return None
    parts = []
    for h in snap.hosts:
        state = ("unreachable" if h.reachable is False else "connecting…" if h.reachable is None
                 else "no GPU telemetry")
        parts.append(f"{h.name}: {state}" + (f", {h.bound.text}" if h.bound is not None else "")
                     + (f" ({cost_cell(h)})" if h.usd_per_hour is not None else ""))
    return "GPUs  " + " · ".join(parts)


class GpuPane(Vertical):
    def compose(self) -> ComposeResult:
        yield Static("GPUs", classes="title", id="gpus-title")
        yield GpuTable(id="gpu-table")

    def show(self, snap: FleetSnapshot, selected: tuple[str, tuple[int, ...]] | None, no_color: bool) -> None:
        line = telemetry_line(snap)
        self.set_class(line is not None, "-oneline")
        title = self.query_one("#gpus-title", Static)
        table = self.query_one(GpuTable)
        if line is not None:
            show_text(title, line)
            table.display = False
            return
        table.display = True
        n = sum(len(h.gpus or []) for h in snap.hosts)
        show_text(title, f"GPUs ({n} on {len(snap.hosts)} host(s))  enter expands a host")
        table.show(snap, selected, no_color)
