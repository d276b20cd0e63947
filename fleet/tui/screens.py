"""Modal screens: confirmation, help (generated from the bindings), and the full-screen log view."""

from __future__ import annotations

from textual.actions import SkipAction
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, Static

from .panes.log import LogView


def pass_to_input(screen) -> None:
    """A priority key (`/`, `:`) pressed while an input has the focus is that input's character:
    the binding passes (SkipAction), and the app forwards the key to the input, in order with the
    keys before it (inserted by the action, it overtook them)."""
    if isinstance(screen.focused, Input):
        raise SkipAction()


class ConfirmScreen(ModalScreen[bool]):
    """A destructive question. The focus starts on the harmless answer, so Enter (or a key typed by
    habit) cancels; only the named key (`key`, `y` unless said) or a click on the action does it."""

    def __init__(self, question: str, verb: str = "Yes", key: str = "y"):
        super().__init__()
        self.question, self.verb, self.key = question, verb, key
        self._bindings.bind(key, "answer(True)", verb.lower())
        self._bindings.bind("n,escape,q", "answer(False)", "cancel")

    def compose(self) -> ComposeResult:
        with Grid():
            yield Label(f"{self.question}\n\n{self.key} {self.verb.lower()} · enter, n or esc cancel",
                        id="question")
            yield Button(f"{self.verb} ({self.key})", variant="error", id="yes")
            yield Button("Cancel (enter, n, esc)", variant="primary", id="no")

    def on_mount(self) -> None:
        self.set_focus(self.query_one("#no", Button))      # at once: a key already typed lands here

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


# --- help ---------------------------------------------------------------------------------------

NOT_BINDINGS = [
    ("Anywhere", [("↑ ↓ / k j", "move the cursor (pgup pgdn home end too)"),
                  ("tab / shift+tab", "next / previous pane (shards, GPUs, log)"),
                  ("ctrl+p", "Textual's command palette (theme, screenshot, keys)")]),
    ("Mouse", [("click a row", "select it (a GPU host: select; double click expands)"),
               ("double click", "a shard: open its log"),
               ("click a header", "sort by that column; again reverses it"),
               ("wheel", "scroll the pane under the pointer")]),
]


def binding_lines(app, bindings) -> list[tuple[str, str]]:
    """(keys, what it does) for each binding, from the bindings themselves: the tooltip when there
    is one, else the footer's description. The nine sort-by-column keys are one line."""
    keys: dict[str, list[str]] = {}
    what: dict[str, str] = {}
    for b in bindings:
        b = b if isinstance(b, Binding) else Binding(*b)
        action = "sort_column" if b.action.startswith("sort_column(") else b.action
        if action.startswith(("cursor", "page")):
            continue
        if action == "sort_column":
            keys[action] = ["1 … 9"]
            what[action] = "sort by the Nth column on screen; again reverses it"
            continue
        keys.setdefault(action, []).extend(app.get_key_display(Binding(k.strip(), b.action))
                                           for k in b.key.split(","))
        what.setdefault(action, b.tooltip or b.description)
    return [(" / ".join(keys[a]), what[a]) for a in keys]


class HelpScreen(ModalScreen[None]):
    """The keys, as the app lists them (`text`: FleetApp's help_text, generated from every binding)."""
    BINDINGS = [Binding("escape,q,question_mark", "dismiss_help", "close")]

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(self.text, id="help-text")

    def action_dismiss_help(self) -> None:
        self.dismiss(None)


# --- the log view -------------------------------------------------------------------------------

class LogScreen(Screen[None]):
    """One shard's log, full screen. Only its own keys work here (the main screen's are on the
    main screen), so `/` searches the log and `l` does not open a second log."""
    BINDINGS = [
        Binding("escape,q", "back", "back", tooltip="back to the shards (esc also closes the search)"),
        Binding("slash", "search", "search", priority=True,     # (a burst after / is the search's: see MainScreen)
                tooltip="search as you type; enter keeps it, n / N go on"),
        Binding("a", "toggle_autoscroll", "autoscroll", tooltip="follow the end of the log, or stay put"),
        Binding("w", "toggle_wrap", "wrap", tooltip="wrap long lines, or cut them (left / right scroll)"),
    ]

    def __init__(self, source, shard: int):
        super().__init__()
        self.source = source
        self.shard = shard

    def compose(self) -> ComposeResult:
        yield Static(f"shard {self.shard} — log", id="log-title")
        yield LogView(id="full-log")
        yield Input(placeholder="search the log (enter keeps it, esc drops it)", id="log-search")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#log-search", Input).display = False
        view = self.query_one(LogView)
        view.follow(self.source, self.shard)
        view.focus()
        for name in ("status", "auto_scroll", "wrap", "search"):     # the title follows the view
            self.watch(view, name, lambda _value: self._title(), init=False)
        self._title()

    def _title(self) -> None:
        view = self.query_one(LogView)
        flags = [f"autoscroll {'on' if view.auto_scroll else 'off'}", f"wrap {'on' if view.wrap else 'off'}"]
        if view.search:
            flags.append(f"search '{view.search}' (n/N)")
        self.query_one("#log-title", Static).update(f"shard {self.shard} — log · {view.status} · "
                                                    + " · ".join(flags))

    def action_back(self) -> None:
        box = self.query_one("#log-search", Input)
        if box.display:
            box.display = False
            self.query_one(LogView).find(None)
            self.query_one(LogView).focus()
            self._title()
            return
        self.app.pop_screen()

    def action_search(self) -> None:
        pass_to_input(self)                              # a / in the search itself
        box = self.query_one("#log-search", Input)
        box.display = True
        box.value = self.query_one(LogView).search or ""
        self.set_focus(box)          # now: a word typed in one burst after / is the search's

    def on_input_changed(self, event: Input.Changed) -> None:
        view = self.query_one(LogView)
        view.find(event.value, 1, from_line=view.cursor - 1)
        self._title()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.input.display = False
        view = self.query_one(LogView)
        if event.value and not view.find(event.value, 1, from_line=view.cursor - 1):
            self.notify(f"pattern not found: {event.value}", severity="warning")
        view.focus()
        self._title()

    def action_toggle_autoscroll(self) -> None:
        view = self.query_one(LogView)
        view.auto_scroll = not view.auto_scroll
        if view.auto_scroll:
            view.action_bottom()
        self._title()

    def action_toggle_wrap(self) -> None:
        view = self.query_one(LogView)
        view.wrap = not view.wrap
        self._title()
