"""GPUs pane: per host, per GPU memory bar, utilisation, temperature, power, and whether the reading
is live or stale (with its age).

A host without telemetry says so; an unreachable host is UNKNOWN, never zeros.
"""

from __future__ import annotations

from rich.text import Text

from ...render import human_bytes
from ..style import bar
from .keyed_table import KeyedTable

COLUMNS = [("host", "host"), ("gpu", "gpu"), ("memory", "mem"), ("util", "util"), ("temp", "temp"),
           ("power", "power"), ("reading", "age")]


def _num(v, unit: str, digits: int = 0) -> str:
    return "—" if v is None else f"{v:.{digits}f}{unit}"


def gpu_rows(snap: dict) -> dict[str, tuple]:
    rows: dict[str, tuple] = {}
    for h in snap["hosts"]:
        name = h["name"]
        if h["reachable"] is False:
            rows[f"{name}/x"] = (name, "—", Text("UNKNOWN: host unreachable", "magenta"), "—", "—", "—",
                                 _num(h.get("last_seen_age_s"), "s"))
            continue
        if h["reachable"] is None:
            rows[f"{name}/x"] = (name, "—", Text("connecting…", "dim"), "—", "—", "—", "—")
            continue
        gpus = h.get("gpus") or []
        if not gpus:
            rows[f"{name}/x"] = (name, "—", Text("no GPU telemetry", "dim"), "—", "—", "—", "—")
            continue
        age_s = h.get("gpu_age_s")
        age = Text(f"stale {age_s:.0f}s", "yellow") if age_s is not None and age_s > 3 else "live"
        for g in gpus:
            if g.get("lost"):
                rows[f"{name}/{g['index']}"] = (name, str(g["index"]), Text("GPU is lost", "red"), "—", "—", "—", age)
                continue
            used, total = g.get("mem_used"), g.get("mem_total")
            frac = used / total if used is not None and total else 0.0
            mem = f"{bar(frac, 12)} {human_bytes(used)}/{human_bytes(total)}"
            if frac >= 0.95:
                mem = Text(mem, "red")                   # colour only where it says something
            rows[f"{name}/{g['index']}"] = (name, str(g["index"]), mem, _num(g.get("util"), "%"),
                                            _num(g.get("temp"), "°C"), _num(g.get("power_w"), " W"), age)
    return rows


class GpuTable(KeyedTable):
    def __init__(self, **kw):
        super().__init__(COLUMNS, **kw)

    def show(self, snap: dict) -> int:
        rows = gpu_rows(snap)
        return self.sync(list(rows), rows.__getitem__)
