"""Top bar: the run, hosts, shards by state; throughput against expected (in tokens when known,
samples/s secondary) and the ETA; progress, bytes, disk, money. A finished run says so in a banner
with what it took and cost, and points at `fleet verify`. Parts that do not fit the width are
dropped, least useful first.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ...render import finished_parts, run_eta_text
from ...schema import FleetSnapshot
from ...state import SEVERITY as STATE_SEVERITY
from ...units import bytes_text, duration, si, usd
from ..style import ALERT, GLYPH, bar, state_style
from .lines import show_text


def fit(parts: list[tuple[int, Text]], width: int, sep: str | Text = "  ") -> Text:
    """Join parts in order, dropping the highest-numbered priorities until the line fits."""
    parts = list(parts)
    while parts:
        line = (Text(sep) if isinstance(sep, str) else sep).join(t for _, t in parts)
        if line.cell_len <= width or len(parts) == 1:
            line.truncate(width, overflow="ellipsis")
            return line
        worst = max(range(len(parts)), key=lambda i: (parts[i][0], i))
        parts.pop(worst)
    return Text()


def state_counts(snap: FleetSnapshot, no_color: bool) -> list[tuple[int, Text]]:
    order = STATE_SEVERITY
    out = []
    for i, state in enumerate(order):
        n = snap.totals.by_state.get(state)
        if n:
            out.append((2 + i // 6, Text(f"{GLYPH[state]} {state} {n}", state_style(state, no_color))))
    return out


def lines(snap: FleetSnapshot, width: int, no_color: bool = False) -> list[Text]:
    """The bar's three lines at `width`: the head, the rate (or a banner once nothing runs), the facts."""
    t = snap.totals
    head = head_parts(snap, no_color)
    if not t.replayed:
        return replaying_lines(snap, head, width)
    head += state_counts(snap, no_color)
    facts = fact_parts(t)
    banner = run_banner(snap, no_color)
    middle = fit(banner, width, Text(" · ", banner[0][1].style)) if banner is not None else fit(rate_parts(t, no_color), width)
    return [fit(head, width), middle, fit(facts, width)]


def head_parts(snap: FleetSnapshot, no_color: bool) -> list[tuple[int, Text]]:
    """The run's name and how many of its hosts are up: always shown, whatever else is known."""
    up = sum(1 for h in snap.hosts if h.reachable)
    head = [(0, Text.assemble(("fleet ", "bold"), (snap.run, "bold" if no_color else "bold cyan"))),
            (1, Text(f"hosts {up}/{len(snap.hosts)}"))]
    behind = [h for h in snap.hosts if h.catching_up]
    if behind:
        worst = max(h.behind_s or 0.0 for h in behind)
        head.append((0, Text(f"catching up{f': {worst:.0f} s behind' if worst else ''}", "italic")))
    return head


def replaying_lines(snap: FleetSnapshot, head: list[tuple[int, Text]], width: int) -> list[Text]:
    """Re-attaching: until the hosts' records are read, every shard would count as PENDING, with
    0 samples/s and no ETA. Say what is happening instead of figures that are not known yet."""
    waiting = sum(1 for h in snap.hosts if not h.replayed and h.reachable is not False)
    head = head + [(0, Text(f"reading hosts… ({waiting} of {len(snap.hosts)} record(s) to replay)", "italic"))]
    return [fit(head, width),
            fit([(0, Text(f"{len(snap.shards)} shard(s): states, rates and the ETA follow once "
                          f"their hosts' records are read", "italic"))], width),
            Text("")]


def fact_parts(t) -> list[tuple[int, Text]]:
    """Progress, elapsed time, bytes, disk and money: the third line, kept in a banner's company."""
    facts = [(0, Text(f"{t.done:,}/{t.total:,} samples"))]
    if t.tokens is not None or t.total_tokens:    # a [job] that reports samples shows no tokens
        facts.append((2, Text(f"{si(t.tokens or 0)}/{si(t.total_tokens)} tokens" if t.total_tokens
                              else f"{si(t.tokens)} tokens")))
    facts.append((1, Text(f"elapsed {duration(t.elapsed_s)}")))
    if t.bytes_written:
        facts.append((3, Text(f"written {bytes_text(t.bytes_written)}")))
    if t.shipping is not None:                    # [run] destination: what has landed, what waits
        sh = t.shipping
        facts.append((3, Text(f"shipped {bytes_text(sh.shipped_bytes)}"
                              + (f", {bytes_text(sh.pending_bytes)} pending" if sh.pending_files else "")
                              + (f" {bytes_text(sh.rate_bps)}/s" if sh.rate_bps else "")
                              + (" (failing, retried)" if sh.error else ""),
                              "bold" if sh.error or sh.waiting else "")))
    if t.disk_full_eta_s:
        facts.append((3, Text(f"disk full in {duration(t.disk_full_eta_s)}",
                              "bold" if t.eta_s and t.disk_full_eta_s < t.eta_s else "")))
    return facts + money_parts(t)


def money_parts(t) -> list[tuple[int, Text]]:
    """Spent, projected (while the run goes on) and per million tokens, for hosts with a price."""
    if t.usd_spent is None:
        return []
    money = [(4, Text(f"{usd(t.usd_spent)} spent")),
             (5, Text(f"{usd(t.usd_projected)} projected" if t.usd_projected is not None and not t.settled
                      else "")),
             (5, Text(f"{usd(t.usd_per_million_tokens)}/Mtok" if t.usd_per_million_tokens is not None
                      else ""))]
    return [m for m in money if m[1].plain]


def run_banner(snap: FleetSnapshot, no_color: bool) -> list[tuple[int, Text]] | None:
    """Instead of the rate, once nothing runs: what the finished run took (what does not fit goes
    from the end, the pointer at `fleet verify` stays), or that it needs a restart; None while
    shards run."""
    t = snap.totals
    if t.finished:
        style = "bold reverse" if no_color else "bold #ffffff on #005f00"   # (ANSI white: 4.2:1 in 256 colours)
        first, *rest = finished_parts(snap)
        return [(0, Text(f"✓ {first}", style)), *((i, Text(p, style)) for i, p in enumerate(rest, 1)),
                (0, Text("→ fleet verify", style))]
    if t.settled:
        counts = ", ".join(f"{n} {s}" for s, n in t.by_state.items())
        return [(0, Text(f"nothing is running: {counts} · r restarts the selected, R every failed one",
                         "bold reverse" if no_color else "bold black on yellow"))]
    return None


def rate_parts(t, no_color: bool) -> list[tuple[int, Text]]:
    """The measured rate (tokens/s when the run counts tokens), against the expected, and the ETA."""
    style = ALERT[no_color][t.alert_level]
    rate: list[tuple[int, Text]] = []
    if t.tokens_per_s is not None and (t.tokens or t.total_tokens):
        rate.append((0, Text(f"{si(t.tokens_per_s)} tok/s", "bold")))
        rate.append((3, Text(f"({t.samples_per_s:,.1f} samples/s)")))
    else:
        rate.append((0, Text(f"{si(t.samples_per_s)} samples/s", "bold")))
    rate += expected_parts(t, style)
    rate.append((0, Text(run_eta_text(t))))
    if t.eta_left_out:
        rate.append((3, Text(f"(leaves out {len(t.eta_left_out)} FATAL/STOPPED)", "italic")))
    return rate


def expected_parts(t, style: str) -> list[tuple[int, Text]]:
    """The expected rate in the ratio's unit and the measured share of it as a bar (nothing when
    no rate is expected)."""
    unit = t.ratio_unit or "samples"
    expected = t.expected_tokens_per_s if unit == "tokens" else t.expected_per_s
    if not expected:
        return []
    parts = [(2, Text(f"expected {si(expected)} {'tok' if unit == 'tokens' else 'samples'}/s"
                      f" ({t.gpus_expected} GPU{'' if t.gpus_expected == 1 else 's'})"))]
    if t.ratio is not None:             # the share before the bar: at 60 columns the bar goes, the share stays
        parts.append((1, Text(f"{t.ratio:.0%} of expected", style)))
        parts.append((3, Text(bar(min(t.ratio, 1.0), 12), style)))
    else:
        parts.append((1, Text("not measured yet", "italic")))
    return parts


class TopBar(Static):
    def show(self, snap: FleetSnapshot, no_color: bool = False) -> None:
        self._last = (snap, no_color)
        width = max(self.content_region.width, 20)
        show_text(self, Text("\n").join(lines(snap, width, no_color)))

    def on_resize(self) -> None:
        if getattr(self, "_last", None):
            self.show(*self._last)
