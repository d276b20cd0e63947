"""The main screen: top bar, GPUs, shards (with the selected shard's details), throughput, the
selected shard's log; its keys act on shards and live here, not on the app, so they never leak
into the log view.

Layout by size (Textual breakpoints set the classes, app.tcss places the panes): from 140 columns
the GPU pane sits left of the shards, below it stacks above them; below 30 rows the chart and the
log pane give their rows to the shards. Keys redraw from the last snapshot at once; new snapshots
arrive on the app's timer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, cast

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.suggester import SuggestFromList
from textual.widgets import Footer, Input, Static

from .. import notify
from ..schema import FleetSnapshot
from ..state import RESTARTABLE
from .commands import COMMANDS, CommandError, parse
from .panes.gpus import GpuPane, GpuTable
from .panes.lines import LineTable, show_text
from .panes.log import LogView
from .panes.shards import regex_problem, COLUMN_KEYS, COLUMNS as SHARD_COLUMNS, ShardDetail, ShardTable, View, replaying_hosts
from .panes.throughput import BUCKET_S, ThroughputChart
from .panes.topbar import TopBar
from .screens import ConfirmScreen, LogScreen, pass_to_input

if TYPE_CHECKING:
    from ..source import FleetSource


class ViewApp(Protocol):
    """What this screen asks of its app beyond Textual's App (fleet/tui/app.py's FleetApp), typed
    without importing it: the app imports this screen."""
    source: FleetSource
    no_color: bool

    def action_help(self) -> Any: ...
    def action_quit_fleet(self) -> Any: ...
    def run_action_job(self, job) -> Any: ...     # a Textual @work: calling it starts it

def gpus_of(s) -> tuple[str, tuple[int, ...]] | None:
    """The host and GPUs of a shard, for the GPU pane to highlight."""
    return (s.host, tuple(s.gpus or (s.gpu,))) if s is not None else None


TOLD = {"FAILED", "FATAL", "STALLED", "finished"}   # what a toast (and the bell) tells while you watch


SHORT_LOG_MIN = 3            # lines of log worth showing on a terminal under 30 rows


class MainScreen(Screen):
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (140, "-wide")]
    VERTICAL_BREAKPOINTS = [(0, "-short"), (30, "-tall"), (50, "-taller")]
    BINDINGS = [
        Binding("r", "restart", "restart", tooltip="restart the selected (or marked) shards; asks first"),
        Binding("R", "restart_failed", "restart failed",
                tooltip="restart every FAILED / BACKOFF / FATAL shard; asks first"),
        Binding("space", "mark", "mark", tooltip="mark or unmark the selected shard for r and x"),
        Binding("x", "stop", "stop", tooltip="stop the selected (or marked) shards: STOPPED; asks first"),
        Binding("l,enter", "log", "log", tooltip="the selected shard's log, full screen"),
        # priority: the app runs these as it reads them, so the keys typed after them in one burst
        # are forwarded to the input they open, not to the table (see screens.pass_to_input)
        Binding("slash", "filter", "filter", priority=True,
                tooltip="filter as you type: a regex (!regex hides the matches)"),
        Binding("colon", "command", "command", priority=True,
                tooltip=":restart 17  :stop 3-5  :host box05  :state failed  …"),
        Binding("f", "faulty", "faulty", tooltip="only faulty shards (STALLED FAILED BACKOFF FATAL UNKNOWN)"),
        Binding("s", "sort_next", "sort", tooltip="sort by the next column (the header marks it ▲ / ▼)"),
        Binding("S", "sort_reverse", "reverse", show=False, tooltip="reverse the sort"),
        *[Binding(str(n + 1), f"sort_column({n})", f"sort {n + 1}", show=False) for n in range(9)],
        Binding("D", "stop_all", "stop run", tooltip="stop every shard on every host; asks: D again confirms"),
        Binding("escape", "clear", "clear", show=False, tooltip="clear filters and marks, close the input"),
    ]


    @property
    def fleet(self) -> ViewApp:
        """The app, as this screen uses it (the FleetApp)."""
        return cast(ViewApp, self.app)

    def __init__(self):
        super().__init__()
        self.view = View()
        self.snap: FleetSnapshot | None = None
        self._keys_shown: tuple | None = None

    @property
    def no_color(self) -> bool:
        return self.fleet.no_color

    FIRST_KEYS = ("help", "quit_fleet")       # the footer cuts what does not fit: these never

    @property
    def active_bindings(self):
        """Screen's own, with help and quit first: the footer shows keys in this order."""
        bindings = super().active_bindings
        first = {k: v for k, v in bindings.items() if v.binding.action in self.FIRST_KEYS}
        return {**first, **{k: v for k, v in bindings.items() if k not in first}}

    def compose(self) -> ComposeResult:
        yield TopBar(id="top")
        with Horizontal(id="middle"):
            yield GpuPane(id="gpus")
            with Vertical(id="right"):
                yield Static("shards", classes="title", id="shards-title")
                yield ShardTable(id="shards")
                yield ShardDetail(id="detail")
        yield ThroughputChart(id="throughput")
        yield Static("log", classes="title", id="log-title")
        yield LogView(id="log")
        yield Input(placeholder="filter: regex on id, host:gpu, state, reason — !negates · enter keeps · esc clears",
                    id="filter")
        yield Input(placeholder=":restart 17 · :stop 3-5 · :log 17 · :host box05 · :state failed · :sort eta",
                    id="command", suggester=SuggestFromList([f"{c} " for c in COMMANDS]))
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#filter", Input).display = False
        self.query_one("#command", Input).display = False
        self.query_one(ShardTable).focus()
        if self.snap is not None:
            snap, self.snap = self.snap, None
            self.draw(snap)

    # --- drawing ----------------------------------------------------------------------------------
    def draw(self, snap: FleetSnapshot) -> None:
        """A new snapshot: redraw, and tell (toast and bell) failures that happen while watching."""
        first = self.snap is None or not self.snap.totals.replayed
        self.snap = snap
        if not self.query(ShardTable):
            return                                  # not composed yet: on_mount draws it
        if snap.totals.replayed and first and not self.query_one(ThroughputChart).rebuilt:
            self.rebuild_chart(snap)
        self.query_one(ThroughputChart).add(snap)
        self.query_one(GpuTable).observe(snap)
        self.redraw()

    @work(exclusive=True, group="chart")
    async def rebuild_chart(self, snap: FleetSnapshot) -> None:
        """The chart's past from the records (the source rebuilds it: a remote supervisor answers
        over its socket), at the resolution the chart will draw it: a run shorter than the chart's
        width in 10 s columns is rebuilt in finer steps (and no longer)."""
        history = getattr(self.fleet.source, "history", None)
        chart = self.query_one(ThroughputChart)
        if history is None or chart.rebuilt:
            return
        width = max(chart.size.width, 60)
        step = min(BUCKET_S, max((snap.totals.elapsed_s or 0.0) / width, 0.25))
        past = await history(step, width)
        if not chart.rebuilt:
            chart.fill(past, "tokens" if snap.totals.tokens is not None else "samples")
            chart.refresh()

    def tell(self, changes, snap: FleetSnapshot) -> None:
        """Transitions published while watching: a toast (and the bell) for what needs a look."""
        for n in notify.notices(changes, snap):
            if n.event in TOLD:
                self.notify(n.message, severity="information" if n.event == "finished" else "error", timeout=8)
                if n.event != "finished":
                    self.app.bell()

    def redraw(self) -> None:
        """Draw the last snapshot as the view says (a keypress needs no new snapshot)."""
        snap = self.snap
        if snap is None or not self.query(ShardTable):
            return                                  # not composed yet: on_mount draws it
        with self.app.batch_update():
            self.query_one(TopBar).show(snap, self.no_color)
            table = self.query_one(ShardTable)
            table.show(snap, self.view, self.no_color)
            selected = self.selected_status()
            self._show_detail(selected)
            self.query_one(GpuPane).show(snap, gpus_of(selected),
                                         self.no_color)
            self.query_one("#middle").set_class(not any(h.gpus for h in snap.hosts), "-no-telemetry")
            header = next((c.label for c in SHARD_COLUMNS if c.key == self.view.sort), self.view.sort)
            hidden = " (column off screen)" if table.size.width > 1 and \
                self.view.sort not in table.visible_columns() else ""
            sort = f"sort {header}{'▼' if self.view.reverse else '▲'}{hidden}"
            show_text(self.query_one("#shards-title", Static),
                f"shards ({table.row_count}/{len(snap.shards)})  " + " · ".join([sort] + self.view.describe()))
        self.fit_middle()
        log = self.query_one("#log", LogView)
        log.follow(self.fleet.source, table.selected_shard)
        messages = getattr(self.fleet.source, "messages", None)
        last = f" · supervisor: {messages[-1]}" if messages else ""
        show_text(self.query_one("#log-title", Static),
            f"log of shard {table.selected_shard} ({log.status}){last}" if table.selected_shard is not None
            else "log")
        keys = self._key_state()
        if keys != self._keys_shown:                # the footer is rebuilt on each refresh: only on a change
            self._keys_shown = keys
            self.refresh_bindings()

    def fit_middle(self) -> None:
        """Give the shards (and the GPU pane) the rows they need and the log the rest: a run of 2
        shards at 120x40 left 15 blank rows under its table, 4 shards at 80x24 eleven. Up to what the
        top bar, the chart and the log's minimum leave; below 30 rows there is no chart, and the log
        is shown only where the shards leave it SHORT_LOG_MIN rows (else the middle takes them all)."""
        middle = self.query_one("#middle")
        want = self._wanted_rows()
        if self.has_class("-short"):
            spare = self.size.height - 3 - want - 1                  # top bar, footer
            self.set_class(spare < 1 + SHORT_LOG_MIN, "-no-log")
            height = want if spare >= 1 + SHORT_LOG_MIN else None
        else:
            self.set_class(False, "-no-log")
            chart = self.query_one(ThroughputChart).outer_size.height
            log_min = 10 if self.has_class("-taller") else 6
            room = self.size.height - 3 - chart - 1 - log_min - 1     # top bar, chart, log title, log, footer
            height = max(min(want, room), 4)
        current = middle.styles.height
        if height is None and current is not None and current.unit.name == "FRACTION" and current.value == 1:
            return
        if height is None:
            middle.styles.height = "1fr"
        elif current is None or current.unit.name != "CELLS" or current.value != height:
            middle.styles.height = height

    def _wanted_rows(self) -> int:
        """The rows the middle needs: the shards' title, header, rows and detail, and the GPU pane
        beside them or (narrow) above them."""
        middle = self.query_one("#middle")
        table = self.query_one(ShardTable)
        right = 1 + table.row_count + 1 + 2              # title, header + rows, detail
        gpu_keys = len(self.query_one(GpuTable).keys)
        if middle.has_class("-no-telemetry"):
            return right + 1                              # the GPU pane is one line
        if self.has_class("-narrow"):                     # above the shards: app.tcss's caps
            return right + min(1 + min(gpu_keys + 1, 12), int(self.size.height * 0.35))
        return max(right, 1 + gpu_keys + 1)

    def on_resize(self) -> None:
        if self.snap is not None:
            self.call_after_refresh(self.fit_middle)

    def _marked(self, s) -> bool:
        return s is not None and s.id in self.view.marked

    def selected_status(self):
        k = self.query_one(ShardTable).selected_shard
        if self.snap is None or k is None:
            return None
        return next((s for s in self.snap.shards if s.id == k), None)

    def _show_detail(self, selected) -> None:
        waiting = selected is not None and self.snap is not None and selected.host in replaying_hosts(self.snap)
        self.query_one(ShardDetail).show(selected, self.no_color, self._marked(selected), waiting)

    @on(LineTable.CursorMoved, "#shards")
    def _cursor_moved(self) -> None:
        if self.snap is not None:
            selected = self.selected_status()
            self._show_detail(selected)
            self.query_one(GpuPane).show(self.snap, gpus_of(selected),
                                         self.no_color)
            self.query_one("#log", LogView).follow(self.fleet.source, self.query_one(ShardTable).selected_shard)

    @on(GpuTable.Toggled)
    def _gpus_toggled(self) -> None:
        self.redraw()

    @on(LineTable.HeaderClicked, "#shards")
    def _header_clicked(self, event: LineTable.HeaderClicked) -> None:
        self.sort_by(event.column)

    @on(LineTable.RowActivated, "#shards")
    def _row_activated(self) -> None:
        self.action_log()

    # --- keys -------------------------------------------------------------------------------------
    def _key_state(self) -> tuple:
        """What check_action's answers depend on."""
        return (bool(self.snap and self.snap.totals.finished),
                self.query_one(ShardTable).selected_shard is not None)

    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Keys that cannot apply now are hidden (a finished run has nothing to restart or stop)."""
        finished = bool(self.snap and self.snap.totals.finished)
        if action in ("restart", "restart_failed", "stop", "stop_all") and finished:
            return False
        if action in ("restart", "stop", "log", "mark"):
            return self.query_one(ShardTable).selected_shard is not None or None
        return True

    def _targets(self) -> list[int]:
        if self.view.marked:
            return sorted(self.view.marked)
        k = self.query_one(ShardTable).selected_shard
        return [k] if k is not None else []

    def _restartable(self) -> list[int]:
        return [s.id for s in self.snap.shards if s.state in RESTARTABLE] if self.snap else []

    def _confirm_then(self, question: str, job, verb: str, key: str = "y") -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.fleet.run_action_job(job)
        self.app.push_screen(ConfirmScreen(question, verb, key), answered)

    def _allowed(self, ids: list[int], kind: str) -> list[int]:
        """The shards `kind` may apply to, by the one rule every caller uses; the rest are told."""
        refused = {k: self.fleet.source.refusal(k, kind) for k in ids}
        told = [why for why in refused.values() if why]
        if told:
            self.app.notify("\n".join(told[:5]) + (f"\n… and {len(told) - 5} more" if len(told) > 5 else ""),
                            severity="warning")
        return [k for k in ids if not refused[k]]

    def restart(self, ids: list[int]) -> None:
        ids = self._allowed(ids, "restart")
        if ids:
            self._confirm_then(f"Restart shard(s) {', '.join(map(str, ids))}? They resume where they stopped.",
                               lambda: self.fleet.source.restart(ids), "Restart")

    def stop(self, ids: list[int]) -> None:
        ids = self._allowed(ids, "stop")
        if ids:
            self._confirm_then(f"Stop shard(s) {', '.join(map(str, ids))}? They show STOPPED and are not "
                               f"restarted until you say so. Output already written stays.",
                               lambda: self.fleet.source.stop(ids), "Stop")

    def action_restart(self) -> None:
        self.restart(self._targets())

    def action_restart_failed(self) -> None:
        ids = self._restartable()
        if ids:
            self._confirm_then(f"Restart {len(ids)} FAILED/BACKOFF/FATAL shard(s): {', '.join(map(str, ids))}?",
                               lambda: self.fleet.source.restart(ids), "Restart")
        else:
            self.notify("nothing to restart: no shard is FAILED, BACKOFF or FATAL")

    def action_stop(self) -> None:
        self.stop(self._targets())

    def action_stop_all(self) -> None:
        self._confirm_then("Stop the WHOLE run (every shard on every host)? Starting them again costs a model load each.",
                           self.fleet.source.stop_all, "Stop the run", key="D")

    def action_mark(self) -> None:
        """Mark or unmark the selected shard: the one the detail line shows, whichever pane has
        the focus. The cursor stays on it, so the detail line shows what was marked (it says
        "● marked"); r and k then act on every marked shard."""
        k = self.query_one(ShardTable).selected_shard
        if k is not None:
            self.view.marked.symmetric_difference_update({k})
            self.redraw()

    def action_log(self, shard: int | None = None) -> None:
        k = self.query_one(ShardTable).selected_shard if shard is None else shard
        if k is not None:
            self.app.push_screen(LogScreen(self.fleet.source, k))

    def action_filter(self) -> None:
        pass_to_input(self)
        box = self.query_one("#filter", Input)
        self.query_one("#command", Input).display = False
        box.display = True
        box.value = self.view.query
        self.set_focus(box)          # now: the app forwards the next keys it reads to the focused input

    def action_command(self) -> None:
        pass_to_input(self)
        box = self.query_one("#command", Input)
        self.query_one("#filter", Input).display = False
        box.display = True
        box.value = ""
        self.set_focus(box)          # now: a command typed in one burst goes to the input

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.view.query = event.value.strip()
        event.input.border_subtitle = regex_problem(self.view.query) or ""   # said, not silently literal
        self.redraw()

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self.view.query = event.value.strip()
        self._close_inputs()

    @on(Input.Submitted, "#command")
    def _command_submitted(self, event: Input.Submitted) -> None:
        self._close_inputs()
        self.run_command(event.value)

    def _close_inputs(self) -> None:
        for box in self.query(Input):
            box.display = False
        self.query_one(ShardTable).focus()
        if self.snap is not None:
            snap, self.snap = self.snap, None
            self.draw(snap)

    def run_command(self, line: str) -> None:
        snap = self.snap
        if snap is None or not line.strip():
            return
        try:
            cmd = parse(line, {s.id for s in snap.shards}, {s.id: s.state.value for s in snap.shards},
                        {h.name for h in snap.hosts}, COLUMN_KEYS)
        except CommandError as e:
            self.notify(str(e), severity="error")
            return
        if cmd.name == "restart":
            self.restart(list(cmd.shards))
        elif cmd.name == "stop":
            self.stop(list(cmd.shards))
        elif cmd.name == "log":
            self.action_log(cmd.shards[0])
        elif cmd.name == "host":
            self.view.host = cmd.arg or None
        elif cmd.name == "state":
            self.view.states = frozenset(cmd.arg.split(",")) if cmd.arg else frozenset()
        elif cmd.name == "sort":
            self.view.sort, self.view.reverse = cmd.arg, cmd.reverse
        elif cmd.name == "filter":
            self.view.query = cmd.arg
        elif cmd.name == "clear":
            self.action_clear()
        elif cmd.name == "help":
            self.fleet.action_help()
        elif cmd.name == "quit":
            self.fleet.action_quit_fleet()
        self.redraw()

    def action_clear(self) -> None:
        self.view = View(sort=self.view.sort, reverse=self.view.reverse)
        self._close_inputs()

    def action_faulty(self) -> None:
        if not self.view.faulty_only and self.snap is not None and not any(s.faulty for s in self.snap.shards):
            self.notify("no faulty shard (STALLED, FAILED, BACKOFF, FATAL, UNKNOWN): nothing to filter to")
            return
        self.view.faulty_only = not self.view.faulty_only
        self.redraw()

    def sort_by(self, column: str) -> None:
        if self.view.sort == column:
            self.view.reverse = not self.view.reverse
        else:
            self.view.sort, self.view.reverse = column, False
        self.redraw()

    def action_sort_next(self) -> None:
        shown = self.query_one(ShardTable).visible_columns()
        i = shown.index(self.view.sort) if self.view.sort in shown else -1
        self.view.sort, self.view.reverse = shown[(i + 1) % len(shown)], False
        self.redraw()

    def action_sort_reverse(self) -> None:
        self.view.reverse = not self.view.reverse
        self.redraw()

    def action_sort_column(self, n: int) -> None:
        shown = self.query_one(ShardTable).visible_columns()
        if n < len(shown):
            self.sort_by(shown[n])
