"""`fleet up`'s live screen: the app holds the source, pulls snapshots on a timer and quits; the
main screen (main.py) draws them and owns the keys that act on shards.

Snapshots are pulled every 1.5 s (htop's default; a keypress redraws at once from the last one,
and the supervisor never blocks on the screen); a refresh message that a newer one supersedes says
so with `can_replace`, so a slow screen skips stale snapshots instead of queueing them. Key actions
go to the source (the supervisor), never to SSH directly.
"""

from __future__ import annotations

import os
from typing import Awaitable, Callable

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.message import Message

from ..render import QUIT_MESSAGE, quit_message
from ..schema import FleetSnapshot
from .main import MainScreen
from .panes.gpus import GpuTable
from .panes.log import LogView
from .screens import NOT_BINDINGS, HelpScreen, LogScreen, binding_lines

__all__ = ["FleetApp", "QUIT_MESSAGE", "run_tui"]


class Refresh(Message):
    """Time to draw the newest snapshot; a newer one replaces a pending one."""

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, Refresh)


class Changed(Message):
    """Shards changed state (the supervisor's transitions of one decide pass)."""

    def __init__(self, changes: list) -> None:
        super().__init__()
        self.changes = changes


class FleetApp(App[str]):
    CSS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "app.tcss")  # subclasses too
    TITLE = "fleet"
    BINDINGS = [
        Binding("question_mark", "help", "help", tooltip="this help, generated from the keys themselves"),
        Binding("q", "quit_fleet", "quit", tooltip="quit the view; the workers keep running"),
        Binding("ctrl+c", "quit_fleet", "quit", show=False, priority=True, tooltip="quit, like q"),
    ]

    def __init__(self, source=None, interval: float = 1.5,
                 open_source: Callable[[], Awaitable] | None = None):
        """`source` feeds the screen; or `open_source` makes one in the app's own event loop
        (a live supervisor must run there) and the app closes it on exit."""
        # NO_COLOR means no colour: with the terminal's own colours Textual strips every colour
        # (its default under NO_COLOR turns them into 256-colour greys).
        super().__init__(ansi_color=True if "NO_COLOR" in os.environ else None)
        self.source = source
        self.open_source = open_source
        self.interval = interval

    def get_default_screen(self) -> MainScreen:
        return MainScreen()

    def get_system_commands(self, screen):
        """ctrl+p offers fleet's own actions beside Textual's (each runs the key's action, so it
        asks first and follows the same rule)."""
        yield from super().get_system_commands(screen)
        main = self.main if self.screen_stack else None
        if main is None:
            return
        for title, help_text, action in (
                ("Restart the selected shard(s)", "r: stop if live, then launch; resumes", main.action_restart),
                ("Restart every failed shard", "R: FAILED, BACKOFF and FATAL shards", main.action_restart_failed),
                ("Stop the selected shard(s)", "k: STOPPED, never restarted by itself", main.action_stop),
                ("Stop the whole run", "D: every shard on every host", main.action_stop_all),
                ("Show the selected shard's log", "l", main.action_log),
                ("Only faulty shards", "f: toggle", main.action_faulty),
                ("Filter shards", "/: a regex on id, host:gpu, state, reason", main.action_filter)):
            yield SystemCommand(title, help_text, action)

    @property
    def main(self) -> MainScreen:
        """The main screen: panes are looked up there, so a redraw under a modal never fails."""
        main = self.screen_stack[0]
        assert isinstance(main, MainScreen), "the default screen (get_default_screen) is the bottom one"
        return main

    @property
    def snap(self) -> FleetSnapshot | None:
        return self.main.snap if self.screen_stack else None

    async def on_mount(self) -> None:
        if self.open_source is not None:
            self.source = await self.open_source()
        if (subscribe := getattr(self.source, "subscribe", None)) is not None:
            subscribe(lambda changes: self.post_message(Changed(changes)))
        self.set_interval(self.interval, lambda: self.post_message(Refresh()))
        self.post_message(Refresh())

    def on_refresh(self, _: Refresh) -> None:
        if self.source is not None and self.screen_stack:       # not while closing
            self.draw(self.source.snapshot())

    def on_changed(self, message: Changed) -> None:
        if self.source is not None and self.screen_stack:
            self.main.tell(message.changes, self.source.snapshot())

    def draw(self, snap: FleetSnapshot) -> None:
        self.main.draw(snap)

    @work(exclusive=False)
    async def run_action_job(self, job) -> None:
        try:
            lines = await job()
        except Exception as e:
            self.notify(f"failed: {e}", severity="error")
            return
        self.notify("\n".join(lines) or "done")
        if self.screen_stack:
            self.main.view.marked.clear()
        self.post_message(Refresh())

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(help_text(self)))

    def action_quit_fleet(self) -> None:
        self.exit(quit_message(self.snap))

    async def on_unmount(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            await close()


async def run_tui(client, connect, snap: FleetSnapshot) -> str | None:
    """The live view as a client of the run's supervisor (fleet/client.py), in this event loop;
    returns what to print once it closes. Quitting leaves the supervisor supervising; if it goes
    away meanwhile, the view closes and says so."""
    from ..client import RemoteSource

    app = FleetApp()
    gone: list[str] = []

    def on_gone(why: str) -> None:
        if not gone:
            gone.append(why)
            app.exit(f"fleet: the run's supervisor went away ({why}); the workers keep running. "
                     f"`fleet up` starts it again, `fleet status` reads the hosts.")
    app.source = RemoteSource(client, connect, snap, on_gone=on_gone)
    message = await app.run_async()
    if message and not gone:
        message += f"\n  (its supervisor: {snap.supervisor})" if snap.supervisor else ""
    return message


def help_text(app) -> str:
    """Every key of every screen, one line each, never wrapped: generated from the bindings."""
    sections = [
        ("Shards (the main screen)", binding_lines(app, MainScreen.BINDINGS)),
        ("GPU pane", binding_lines(app, GpuTable.BINDINGS)),
        ("Log view (l or enter)", binding_lines(app, LogScreen.BINDINGS + LogView.BINDINGS)),
        ("Anywhere", binding_lines(app, FleetApp.BINDINGS) + NOT_BINDINGS[0][1]),
        NOT_BINDINGS[1],
    ]
    width = max(len(k) for _, lines in sections for k, _ in lines)
    out = ["[i]esc, q or ? closes this help; up / down / page keys scroll it[/i]", ""]
    for title, lines in sections:
        out.append(f"[b]{title}[/b]")
        out += [f"  {k.ljust(width)}  {what}" for k, what in lines]
        out.append("")
    out.append("A restarted shard resumes: it skips every sample in its manifest.")
    return "\n".join(out)
