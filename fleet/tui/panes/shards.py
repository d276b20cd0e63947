"""Shards pane: state in colour, progress, rates, restarts, last event, reason; marks, filter, sort."""

from __future__ import annotations

from rich.text import Text

from ...render import rate_text
from ...snapshot import FleetSnapshot, ShardStatus
from ..style import STATE_STYLE, bar
from .keyed_table import KeyedTable

COLUMNS = [(" ", "mark"), ("shard", "id"), ("host:gpu", "where"), ("state", "state"),
           ("progress", "progress"), ("samples/s", "sps"), ("tokens/s", "tps"), ("restarts", "restarts"),
           ("last event", "event"), ("reason", "reason")]
SORTS = ("shard", "state", "progress", "rate")


def _sort_key(mode: str):
    if mode == "state":
        order = ["FATAL", "FAILED", "STALLED", "UNKNOWN", "BACKOFF", "STARTING", "LOADING", "RUNNING",
                 "PENDING", "STOPPED", "DONE"]
        return lambda s: (order.index(s.state.value) if s.state.value in order else 99, s.id)
    if mode == "progress":
        return lambda s: (s.progress if s.progress is not None else -1, s.id)
    if mode == "rate":
        return lambda s: (-(s.samples_per_s or 0.0), s.id)
    return lambda s: s.id


def visible_shards(snap: FleetSnapshot, text_filter: str, faulty_only: bool, sort: str) -> list[ShardStatus]:
    rows = snap.shards
    if faulty_only:
        rows = [s for s in rows if s.faulty]
    if text_filter:
        needle = text_filter.lower()
        rows = [s for s in rows if needle in f"{s.id} {s.host}:{s.gpu} {s.state.value} "
                                              f"{s.reason or ''}".lower()]
    return sorted(rows, key=_sort_key(sort))


def shard_cells(s: ShardStatus, marked: bool) -> tuple:
    progress = f"{bar(s.progress or 0.0, 10)} {s.done + s.skipped}/{s.total}"
    age = f" {s.last_event_age_s:.0f}s ago" if s.last_event_age_s is not None else ""
    reason = s.reason or s.warning or ""
    return ("●" if marked else " ", str(s.id), f"{s.host}:{s.gpu}",
            Text(s.state.value, STATE_STYLE.get(s.state.value, "")), progress,
            rate_text(s.samples_per_s), rate_text(s.tokens_per_s, 0), str(s.restarts),
            f"{s.last_event or '—'}{age}", reason[:80])


class ShardTable(KeyedTable):
    def __init__(self, **kw):
        super().__init__(COLUMNS, **kw)
        self.marked: set[int] = set()

    def show(self, snap: FleetSnapshot, text_filter: str = "", faulty_only: bool = False,
             sort: str = "shard") -> int:
        rows = {str(s.id): s for s in visible_shards(snap, text_filter, faulty_only, sort)}
        return self.sync(list(rows), lambda key: shard_cells(rows[key], rows[key].id in self.marked))

    @property
    def selected_shard(self) -> int | None:
        key = self.selected_key
        return int(key) if key is not None else None
