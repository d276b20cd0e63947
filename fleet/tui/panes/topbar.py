"""Top bar: run, hosts, shards by state, throughput against expected, ETA, bytes, disk-full time."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ...render import human_bytes, human_duration, rate_text
from ...snapshot import FleetSnapshot
from ..style import ALERT_STYLE, STATE_STYLE, bar


class TopBar(Static):
    DEFAULT_CSS = "TopBar { height: 3; padding: 0 1; }"

    def show(self, snap: FleetSnapshot) -> None:
        t = snap.totals
        up = sum(1 for h in snap.hosts if h.reachable)
        line1 = Text.assemble(("fleet ", "bold"), (snap.run, "bold cyan"),
                              f"   hosts {up}/{len(snap.hosts)}   ")
        for state, n in t.by_state.items():
            line1.append(f"{state} {n}  ", STATE_STYLE.get(state, ""))
        style = ALERT_STYLE[t.alert_level]
        unit = t.expected_unit or "samples"
        line2 = Text.assemble(
            f"{rate_text(t.samples_per_s)} samples/s   {rate_text(t.tokens_per_s, 0)} tokens/s   ",
            ("expected " if t.expected_per_s else ""),
            (f"{t.expected_per_s:,.1f} {unit}/s " if t.expected_per_s else ""))
        if t.expected_per_s:
            line2.append(bar(min(t.ratio or 0.0, 1.0), 20), style)
            line2.append(f" {t.ratio:.0%}" if t.ratio is not None else " not measured", style)
        line3 = Text(f"{t.done:,}/{t.total:,} samples   ETA {human_duration(t.eta_s)}   "
                     f"elapsed {human_duration(t.elapsed_s)}   written {human_bytes(t.bytes_written)}   "
                     f"disk full in {human_duration(t.disk_full_eta_s) if t.disk_full_eta_s else '—'}")
        self.update(Text("\n").join([line1, line2, line3]))
