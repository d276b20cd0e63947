"""`fleet up`'s live screen: top bar, GPUs, shards, throughput, the selected shard's log, and keys.

Snapshots are pulled on a timer every 1.5 s (htop's default; a keypress redraws at once, and the
supervisor never blocks on the screen); a refresh message
that a newer one supersedes says so with `can_replace`, so a slow screen skips stale snapshots
instead of queueing them. Key actions go to the source (the supervisor), never to SSH directly.
"""

from __future__ import annotations

import asyncio
import os
from typing import Awaitable, Callable

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Footer, Input, Static

from ..snapshot import FleetSnapshot
from ..state import RESTARTABLE
from .panes.gpus import GpuTable
from .panes.log import ShardLog
from .panes.shards import SORTS, ShardTable
from .panes.throughput import ThroughputPane
from .panes.topbar import TopBar
from .screens import ConfirmScreen, HelpScreen, LogScreen

QUIT_MESSAGE = ("fleet: the workers keep running. `fleet up` re-attaches to them, `fleet status` "
                "shows them, `fleet down` stops them.")


class Refresh(Message):
    """Time to draw the newest snapshot; a newer one replaces a pending one."""

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, Refresh)


class FleetApp(App[str]):
    CSS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "app.tcss")  # subclasses too
    TITLE = "fleet"
    BINDINGS = [
        Binding("r", "restart", "restart"),
        Binding("R", "restart_failed", "restart failed"),
        Binding("space", "mark", "mark"),
        Binding("k", "stop", "stop shard"),
        Binding("l,enter", "log", "log"),
        Binding("slash", "filter", "filter"),
        Binding("f", "faulty", "faulty only"),
        Binding("s", "sort", "sort"),
        Binding("D", "stop_all", "stop run"),
        Binding("escape", "clear_filter", "clear filter", show=False),
        Binding("question_mark", "help", "help"),
        Binding("q", "quit_fleet", "quit"),
    ]

    def __init__(self, source=None, interval: float = 1.5,
                 open_source: Callable[[], Awaitable] | None = None):
        """`source` feeds the screen; or `open_source` makes one in the app's own event loop
        (a live supervisor must run there) and the app closes it on exit."""
        super().__init__()
        self.source = source
        self.open_source = open_source
        self.interval = interval
        self.text_filter = ""
        self.faulty_only = False
        self.sort = SORTS[0]
        self.snap: FleetSnapshot | None = None
        self.cells_written = 0                     # counted for the benchmark

    @property
    def main(self):
        """The main screen: panes are looked up there, so a redraw under a modal never fails."""
        return self.screen_stack[0]

    def compose(self) -> ComposeResult:
        yield TopBar(id="top")
        with Horizontal(id="middle"):
            with Vertical(id="left"):
                yield Static("GPUs", classes="title")
                yield GpuTable(id="gpus")
            with Vertical(id="right"):
                yield Static("shards", classes="title", id="shards-title")
                yield ShardTable(id="shards")
        yield ThroughputPane(id="throughput")
        yield ShardLog(id="log")
        yield Input(placeholder="filter shards: host, state, id, reason (enter to apply, esc to clear)",
                    id="filter")
        yield Footer()

    async def on_mount(self) -> None:
        if self.open_source is not None:
            self.source = await self.open_source()
        self.main.query_one("#filter", Input).display = False
        self.set_interval(self.interval, lambda: self.post_message(Refresh()))
        self.post_message(Refresh())
        self.main.query_one(ShardTable).focus()

    def on_refresh(self, _: Refresh) -> None:
        self.draw(self.source.snapshot())

    def draw(self, snap: FleetSnapshot) -> None:
        self.snap = snap
        with self.batch_update():
            self.main.query_one(TopBar).show(snap)
            self.cells_written += self.main.query_one(GpuTable).show(snap)
            table = self.main.query_one(ShardTable)
            self.cells_written += table.show(snap, self.text_filter, self.faulty_only, self.sort)
            self.main.query_one(ThroughputPane).add(snap)
            views = [f"sort {self.sort}"] + (["faulty only"] if self.faulty_only else []) + \
                ([f"filter '{self.text_filter}'"] if self.text_filter else []) + \
                ([f"{len(table.marked)} marked"] if table.marked else [])
            self.main.query_one("#shards-title", Static).update(
                f"shards ({table.row_count}/{len(snap.shards)})  " + " · ".join(views))
        self.main.query_one(ShardLog).follow(self.source, table.selected_shard)

    # --- keys ----------------------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple) -> bool | None:
        """Hide keys that cannot apply now (the footer shows only what works)."""
        if action in ("restart", "stop", "log", "mark"):
            return self.main.query_one(ShardTable).selected_shard is not None or None
        if action == "restart_failed":
            return bool(self.snap and self._restartable()) or None
        return True

    def _targets(self) -> list[int]:
        table = self.main.query_one(ShardTable)
        if table.marked:
            return sorted(table.marked)
        return [table.selected_shard] if table.selected_shard is not None else []

    def _confirm_then(self, question: str, job) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self.run_action_job(job)
        self.push_screen(ConfirmScreen(question), answered)

    @work(exclusive=False)
    async def run_action_job(self, job) -> None:
        try:
            lines = await job()
        except Exception as e:
            self.notify(f"failed: {e}", severity="error")
            return
        self.notify("\n".join(lines) or "done")
        self.main.query_one(ShardTable).marked.clear()
        self.post_message(Refresh())

    def action_restart(self) -> None:
        ids = self._targets()
        if ids:
            self._confirm_then(f"Restart shard(s) {', '.join(map(str, ids))}? They resume where they stopped.",
                               lambda: self.source.restart(ids))

    def action_restart_failed(self) -> None:
        ids = self._restartable()
        if ids:
            self._confirm_then(f"Restart {len(ids)} FAILED/BACKOFF/FATAL shard(s): {', '.join(map(str, ids))}?",
                               lambda: self.source.restart(ids))

    def _restartable(self) -> list[int]:
        return [s.id for s in self.snap.shards if s.state in RESTARTABLE] if self.snap else []

    def action_stop(self) -> None:
        ids = self._targets()
        if ids:
            self._confirm_then(f"Stop shard(s) {', '.join(map(str, ids))}? Output already written stays.",
                               lambda: self.source.stop(ids))

    def action_stop_all(self) -> None:
        self._confirm_then("Stop the WHOLE run (every shard on every host)?", self.source.stop_all)

    def action_mark(self) -> None:
        table = self.main.query_one(ShardTable)
        k = table.selected_shard
        if k is not None:
            table.marked.symmetric_difference_update({k})
            self.post_message(Refresh())
            table.action_cursor_down()

    def action_log(self) -> None:
        k = self.main.query_one(ShardTable).selected_shard
        if k is not None:
            self.push_screen(LogScreen(self.source, k))

    def action_filter(self) -> None:
        box = self.main.query_one("#filter", Input)
        box.display = True
        box.value = self.text_filter
        box.focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.text_filter = event.value.strip()
        event.input.display = False
        self.main.query_one(ShardTable).focus()
        self.post_message(Refresh())

    def action_clear_filter(self) -> None:
        box = self.main.query_one("#filter", Input)
        box.display = False
        self.text_filter = ""
        self.main.query_one(ShardTable).focus()
        self.post_message(Refresh())

    def action_faulty(self) -> None:
        self.faulty_only = not self.faulty_only
        self.post_message(Refresh())

    def action_sort(self) -> None:
        self.sort = SORTS[(SORTS.index(self.sort) + 1) % len(SORTS)]
        self.post_message(Refresh())

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_quit_fleet(self) -> None:
        self.exit(QUIT_MESSAGE)

    async def on_unmount(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            await close()


def run_tui(config, plan: dict) -> int:
    """Open the live view on a deployed run: follow every host, launch what is not live, draw."""
    from ..supervisor import Supervisor
    from .source import SupervisorSource

    async def open_source() -> SupervisorSource:
        sup = Supervisor(config)
        sup.use_plan(plan)
        await sup.start()
        source = SupervisorSource(sup)
        source.launch_task = asyncio.create_task(sup.launch_all())
        return source

    message = FleetApp(open_source=open_source).run()
    if message:
        print(message)
    return 0
