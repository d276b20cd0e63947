"""GPUs pane: per host, per GPU memory bar, utilisation, temperature, power and reading age.

A host without telemetry says so; an unreachable host is UNKNOWN, never zeros.
"""

from __future__ import annotations

from rich.text import Text

from ...render import human_bytes
from ..style import bar
from .keyed_table import KeyedTable

COLUMNS = [("host", "host"), ("gpu", "gpu"), ("memory", "mem"), ("util", "util"), ("temp", "temp"),
           ("power", "power"), ("age", "age")]


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
        age = _num(h.get("gpu_age_s"), "s")
        for g in gpus:
            if g.get("lost"):
                rows[f"{name}/{g['index']}"] = (name, str(g["index"]), Text("GPU is lost", "red"), "—", "—", "—", age)
                continue
            used, total = g.get("mem_used"), g.get("mem_total")
            frac = used / total if used is not None and total else 0.0
            style = "green" if frac < 0.8 else ("yellow" if frac < 0.95 else "red")
            mem = Text.assemble((bar(frac, 12), style), f" {human_bytes(used)}/{human_bytes(total)}")
            rows[f"{name}/{g['index']}"] = (name, str(g["index"]), mem, _num(g.get("util"), "%"),
                                            _num(g.get("temp"), "°C"), _num(g.get("power_w"), " W"), age)
    return rows


class GpuTable(KeyedTable):
    def __init__(self, **kw):
        super().__init__(COLUMNS, **kw)

    def show(self, snap: dict) -> int:
        return self.sync(gpu_rows(snap))
