"""Shards pane: one line per shard, columns chosen by the width (id, state, progress and rate
first; the reason gets what is left), a live regex filter, a sort by any column, marks; and the
selected shard's details underneath (so at 80 columns its whole reason is still readable).

What a cell says comes computed in the snapshot (state, reason, rates, ETA, restarts); this module
only formats it, filters and orders rows for the view.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from rich.text import Text
from textual.widgets import Static

from ...render import note, restarts_text
from ...schema import FleetSnapshot, ShardStatus
from ...state import MEASURED, SEVERITY as STATE_SEVERITY, State
from ...units import duration, eta, si
from ..style import GLYPH, bar, state_style
from .lines import Column, LineTable, show_text

COLUMNS = [
    Column("id", "shard", 6, 0, "right"),
    Column("where", "host:gpu", 9, 5),
    Column("state", "state", 13, 1),
    Column("progress", "progress", 13, 2),
    Column("tps", "tok/s", 7, 3, "right"),
    Column("sps", "smp/s", 6, 9, "right"),
    Column("eta", "ETA", 7, 6, "right"),
    Column("since", "last prog", 9, 7, "right"),
    Column("restarts", "rst", 5, 8, "right"),
    Column("event", "last event", 14, 11),
    Column("reason", "reason", 26, 4, flex=True),
    Column("failure", "last failure", 28, 10),
]
COLUMN_KEYS = [c.key for c in COLUMNS]
# A run that reports samples only (a [job]): tok/s is kept last, samples/s where tok/s was.
SAMPLE_COLUMNS = [replace(c, priority={"tps": 99, "sps": 3}.get(c.key, c.priority)) for c in COLUMNS]
LATE = {False: "bold yellow", True: "bold"}     # progress later than usual (amber; bold under NO_COLOR)
SEVERITY = list(STATE_SEVERITY)


@dataclass
class View:
    """How the shard list is looked at: filters and order (the screen's state, not the fleet's)."""
    query: str = ""                       # regex over id, host:gpu, state, reason; "!" negates
    faulty_only: bool = False
    host: str | None = None               # :host NAME
    states: frozenset[str] = frozenset()  # :state failed,backoff
    sort: str = "id"
    reverse: bool = False
    marked: set[int] = field(default_factory=set)

    def describe(self) -> list[str]:
        out = []
        if self.query:
            out.append(f"/{self.query}")
        if self.faulty_only:
            out.append("faulty only")
        if self.host:
            out.append(f"host {self.host}")
        if self.states:
            out.append("state " + ",".join(sorted(self.states)))
        if self.marked:
            out.append(f"{len(self.marked)} marked")
        return out


def matcher(query: str):
    """A predicate over a row's text: a case-insensitive regex (a bad one is taken literally);
    a leading "!" negates it."""
    negate = query.startswith("!")
    pattern = query[1:] if negate else query
    if not pattern:
        return lambda text: True
    try:
        rx = re.compile(pattern, re.IGNORECASE)
    except re.error:
        rx = re.compile(re.escape(pattern), re.IGNORECASE)
    return (lambda text: rx.search(text) is None) if negate else (lambda text: rx.search(text) is not None)


def regex_problem(query: str) -> str | None:
    """What is wrong with a filter that is not a valid regex (it is then matched literally)."""
    pattern = query[1:] if query.startswith("!") else query
    try:
        re.compile(pattern)
        return None
    except re.error as e:
        return f"not a regex ({e.msg}): matched as plain text"


def _missing_last(x, reverse: bool):
    """Sort key part that keeps unmeasured values (None) at the end in either direction."""
    return (1, 0) if x is None else (0, -x if reverse else x)


SORT_KEYS = {
    "id": lambda s: s.id,
    "where": lambda s: (s.host, s.gpu),
    "state": lambda s: SEVERITY.index(s.state.value) if s.state.value in SEVERITY else 99,
    "progress": lambda s: s.progress if s.progress is not None else -1.0,
    "restarts": lambda s: (s.auto_attempts, s.restarts),
    "event": lambda s: s.last_event or "",
    "reason": lambda s: s.reason or "",
    "failure": lambda s: s.last_failure or "",
}
MEASURES = {"tps": "tokens_per_s", "sps": "samples_per_s", "eta": "eta_s", "since": "progress_age_s"}


def visible_shards(snap: FleetSnapshot, view: View) -> list[ShardStatus]:
    rows = snap.shards
    if view.faulty_only:
        rows = [s for s in rows if s.faulty]
    if view.host:
        rows = [s for s in rows if s.host == view.host]
    if view.states:
        rows = [s for s in rows if s.state.value in view.states]
    if view.query:
        match = matcher(view.query)
        rows = [s for s in rows if match(f"{s.id} {where(s)} {s.state.value} {s.reason or ''} "
                                         f"{s.last_failure or ''}")]
    if view.sort in MEASURES:              # unmeasured rows stay last whichever way
        name = MEASURES[view.sort]
        return sorted(rows, key=lambda s: (_missing_last(getattr(s, name), view.reverse), s.id))
    key = SORT_KEYS.get(view.sort, SORT_KEYS["id"])
    return sorted(rows, key=lambda s: (key(s), s.id), reverse=view.reverse)


def where(s: ShardStatus) -> str:
    """host:gpu, or host:0,1 for a shard over several GPUs."""
    return f"{s.host}:{','.join(map(str, s.gpus))}" if len(s.gpus) > 1 else f"{s.host}:{s.gpu}"


def state_cell(s: ShardStatus, no_color: bool, replaying: bool) -> tuple:
    if replaying:
        return (("… replaying", "italic"),)
    text = f"{GLYPH.get(s.state.value, ' ')} {s.state.value}"
    if s.backoff_s is not None and s.state.value in ("BACKOFF", "STALLED", "STOPPING") and s.backoff_s > 0:
        text += f" {s.backoff_s:.0f}s"             # counting down to the restart (STOPPING: the SIGKILL)
    return ((text, state_style(s.state.value, no_color)),)


def shard_cells(s: ShardStatus, marked: bool, no_color: bool = False, replaying: bool = False) -> tuple:
    if replaying:
        blank = ""
        return (("●" if marked else " ") + str(s.id), where(s), state_cell(s, no_color, True),
                blank, blank, blank, blank, blank, blank, blank, blank, blank)
    pct = f"{s.progress:4.0%}" if s.progress is not None else "   ?"
    unmeasured = "?" if s.state in MEASURED else "—"      # not yet measured / not applicable
    no_tokens = "—" if s.tokens is None and s.total_tokens is None else unmeasured   # a [job] of samples
    progress = f"{bar(s.progress or 0.0, 8)} {pct}" + ("⚠" if s.over_total else "")
    event = f"{s.last_event or '—'} {duration(s.last_event_age_s)}" if s.last_event_age_s is not None \
        else (s.last_event or "—")
    reason = s.reason or note(s)
    return (("●" if marked else " ") + str(s.id), where(s), state_cell(s, no_color, False),
            progress, si(s.tokens_per_s) if s.tokens_per_s is not None else no_tokens,
            si(s.samples_per_s) if s.samples_per_s is not None else unmeasured,
            eta_text(s, unmeasured), since_cell(s, no_color),
            f"{s.auto_attempts}/{s.max_restarts}", event, reason, s.last_failure or "")


def eta_text(s: ShardStatus, unmeasured: str = "?") -> str:
    """'—' when DONE, '~12m' while the pace behind it is short, '12m' once it holds."""
    if s.state == State.DONE:
        return "—"
    return unmeasured if s.eta_s is None else eta(s.eta_s, s.eta_rough)


def since_cell(s: ShardStatus, no_color: bool) -> tuple | str:
    """How long ago the live attempt last made progress; amber once later than its usual pace."""
    if s.progress_age_s is None:
        return "—"
    text = f"{duration(s.progress_age_s)} ago"
    return ((text, LATE[no_color]),) if s.progress_late else text


class ShardTable(LineTable):
    coloured_on_bar = frozenset({"state"})         # the selected shard keeps its state's colour

    def __init__(self, **kw):
        super().__init__(COLUMNS, **kw)
        self.empty_text = "  no shard matches (esc clears the filter)"

    def show(self, snap: FleetSnapshot, view: View, no_color: bool = False) -> None:
        waiting = replaying_hosts(snap)
        rows = {str(s.id): s for s in visible_shards(snap, view)}
        columns = COLUMNS if snap.totals.tokens is not None or snap.totals.total_tokens is not None else SAMPLE_COLUMNS
        if columns is not self.columns:
            self.columns, self._layout = columns, None
        self.sort_column, self.sort_reverse = view.sort, view.reverse
        self.set_rows(list(rows), lambda key: shard_cells(rows[key], rows[key].id in view.marked, no_color,
                                                          rows[key].host in waiting))

    @property
    def selected_shard(self) -> int | None:
        key = self.selected_key
        return int(key) if key is not None else None


def replaying_hosts(snap: FleetSnapshot) -> set[str]:
    """Hosts whose records are still being read: their shards have no state to show yet."""
    return {h.name for h in snap.hosts if not h.replayed and h.reachable is not False}


def detail(s: ShardStatus | None, no_color: bool = False, marked: bool = False, replaying: bool = False) -> Text:
    """The selected shard in full: where, state, counts, rates, ETA, restarts, and its reason;
    "● marked" when `space` marked it (r and k then act on the marked shards); `replaying`: its
    host's records are still being read (no state, no counts yet), as its row says."""
    if s is None:
        return Text("no shard selected", style="italic")
    t = Text()
    if marked:
        t.append("● marked ", "bold")
    t.append(f"shard {s.id} ", "bold")
    t.append(f"{where(s)}  ")
    if replaying:
        t.append("… replaying: reading its host's records", "italic")
        return t
    t.append(f"{GLYPH.get(s.state.value, '')} {s.state.value}", state_style(s.state.value, no_color))
    tokens = f"  {si(s.tokens or 0)}/{si(s.total_tokens)} tok" if s.total_tokens else \
        f"  {si(s.tokens)} tok" if s.tokens is not None else ""          # a [job] reports samples only
    t.append(f"  {s.done + s.skipped:,}/{s.total:,} samples" + (f" ({s.skipped} skipped)" if s.skipped else "")
             + tokens)
    if s.tokens_per_s is not None:
        t.append(f"  {s.tokens_per_s:,.0f} tok/s ({s.samples_per_s:,.1f} smp/s)")
    if s.eta_s is not None and s.state != State.DONE:
        t.append(f"  ETA {eta_text(s)}")
    if s.progress_age_s is not None:
        usual = f" (usually every {duration(s.progress_interval_s)})" if s.progress_interval_s else ""
        t.append(f"  progress {duration(s.progress_age_s)} ago{usual}",
                 LATE[no_color] if s.progress_late else "")
    t.append(f"  restarts {restarts_text(s)}")
    if s.pid:
        t.append(f"  pid {s.pid}")
    why = s.reason or note(s)
    t.append("\n")
    t.append(why or "no problem", "bold" if s.faulty else "italic")
    if s.reason and note(s):
        t.append(f"   {note(s)}", "italic")
    if s.last_failure and s.last_failure != s.reason:
        t.append(f"   last failure: {s.last_failure}", "italic")
    if s.reference is not None:
        t.append(f"   {s.reference.text}", "bold" if s.reference.failed else "italic")
    return t


class ShardDetail(Static):
    def show(self, s: ShardStatus | None, no_color: bool = False, marked: bool = False,
             replaying: bool = False) -> None:
        show_text(self, detail(s, no_color, marked, replaying))
