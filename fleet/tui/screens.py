"""Modal screens: confirmation, help, and the full-screen log view."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Label, Static

from .panes.log import ShardLog


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS = [Binding("y", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Grid { grid-size: 2; grid-gutter: 1 2; grid-rows: auto 3; padding: 1 2;
                           width: 70; height: auto; border: thick $warning; background: $surface; }
    ConfirmScreen Label { column-span: 2; width: 100%; }
    """

    def __init__(self, question: str):
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Grid():
            yield Label(self.question, id="question")
            yield Button("Yes (y)", variant="error", id="yes")
            yield Button("No (n)", variant="primary", id="no")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


HELP = """\
[b]Keys[/b]

  r          restart the selected shard (or the marked ones)  — asks first
  R          restart every FAILED / BACKOFF / FATAL shard       — asks first
  space      mark / unmark the selected shard for r or k
  k          stop the selected shard (or the marked ones)      — asks first
  l, enter   full-screen log of the selected shard; esc back
  /          filter shards (host, state, id, reason); esc clears
  f          only faulty shards (STALLED, FAILED, BACKOFF, FATAL, UNKNOWN)
  s          sort: shard → state → progress → rate
  D          stop the whole run                                 — asks first
  q          quit: the workers keep running; `fleet up` re-attaches
  ?          this help

Restarts resume: a restarted shard skips every sample already in its manifest.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "dismiss_help", "close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical { width: 80; height: auto; padding: 1 2; border: thick $primary; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP)

    def action_dismiss_help(self) -> None:
        self.dismiss(None)


class LogScreen(Screen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "back"),
                Binding("a", "toggle_autoscroll", "autoscroll"),
                Binding("w", "toggle_wrap", "wrap")]

    def __init__(self, source, shard: int):
        super().__init__()
        self.source = source
        self.shard = shard

    def compose(self) -> ComposeResult:
        yield Static(f"shard {self.shard} — log (esc back, a autoscroll, w wrap)", id="log-title")
        yield ShardLog(id="full-log")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one(ShardLog).follow(self.source, self.shard)

    def action_toggle_autoscroll(self) -> None:
        log = self.query_one(ShardLog)
        log.auto_scroll = not log.auto_scroll
        self.notify(f"autoscroll {'on' if log.auto_scroll else 'off'}")

    def action_toggle_wrap(self) -> None:
        log = self.query_one(ShardLog)
        log.wrap = not log.wrap
        self.notify(f"wrap {'on' if log.wrap else 'off'}")
