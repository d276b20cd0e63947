"""GPUs pane: per host, per GPU memory bar, utilisation, temperature, power, and whether the reading
is live or stale (with its age).

A host without telemetry says so; an unreachable host is UNKNOWN, never zeros.
"""

from __future__ import annotations

from rich.text import Text

from ...render import human_bytes
from ...snapshot import FleetSnapshot
from ..style import bar
from .keyed_table import KeyedTable

COLUMNS = [("host", "host"), ("gpu", "gpu"), ("memory", "mem"), ("util", "util"), ("temp", "temp"),
           ("power", "power"), ("reading", "age")]


def _num(v, unit: str, digits: int = 0) -> str:
    return "—" if v is None else f"{v:.{digits}f}{unit}"


def gpu_rows(snap: FleetSnapshot) -> dict[str, tuple]:
    rows: dict[str, tuple] = {}
    for h in snap.hosts:
        name = h.name
        if h.reachable is False:
            rows[f"{name}/x"] = (name, "—", Text("UNKNOWN: host unreachable", "magenta"), "—", "—", "—",
                                 _num(h.last_seen_age_s, "s"))
            continue
        if h.reachable is None:
            rows[f"{name}/x"] = (name, "—", Text("connecting…", "dim"), "—", "—", "—", "—")
            continue
        if not h.gpus:
            rows[f"{name}/x"] = (name, "—", Text("no GPU telemetry", "dim"), "—", "—", "—", "—")
            continue
        age_s = h.gpu_age_s
        age = Text(f"stale {age_s:.0f}s", "yellow") if age_s is not None and age_s > 3 else "live"
        for g in h.gpus:
            if g.lost:
                rows[f"{name}/{g.index}"] = (name, str(g.index), Text("GPU is lost", "red"), "—", "—", "—", age)
                continue
            used, total = g.mem_used, g.mem_total
            frac = used / total if used is not None and total else 0.0
            mem = f"{bar(frac, 12)} {human_bytes(used)}/{human_bytes(total)}"
            if frac >= 0.95:
                mem = Text(mem, "red")                   # colour only where it says something
            rows[f"{name}/{g.index}"] = (name, str(g.index), mem, _num(g.util, "%"),
                                         _num(g.temp, "°C"), _num(g.power_w, " W"), age)
    return rows


class GpuTable(KeyedTable):
    def __init__(self, **kw):
        super().__init__(COLUMNS, **kw)

    def show(self, snap: FleetSnapshot) -> int:
        rows = gpu_rows(snap)
        return self.sync(list(rows), rows.__getitem__)
