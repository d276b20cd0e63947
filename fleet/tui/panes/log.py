"""A shard's log, read like `less`: a cursor line, `/` search with n/N, g/G, `y` copies the line,
autoscroll and wrap toggles; repeated progress lines (lines that differ only in their numbers)
collapse into one line that updates; the stream says when it dropped and when it came back.

Following runs as a Textual worker (`exclusive`: following another shard cancels the last one).
The buffer is capped, so memory stays flat over hours.
"""

from __future__ import annotations

import asyncio
import re
import time

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding
from textual.geometry import Size
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

MAX_LINES = 2000
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def shape(line: str) -> str:
    """A line with its numbers blanked: two progress lines of the same loop have the same shape."""
    return _NUMBER.sub("#", line)


def folded(text: str, n: int) -> str:
    """A line and how many times it updated in place, the count first: at the end it was cut off
    on any line wider than the pane."""
    return f"(×{n + 1}) {text}" if n else text


class LogView(ScrollView, can_focus=True):
    COMPONENT_CLASSES = {"logview--cursor", "logview--match", "logview--note", "logview--bad"}
    BINDINGS = [
        Binding("up,k", "cursor(-1)", "up", show=False),
        Binding("down,j", "cursor(1)", "down", show=False),
        Binding("pageup", "page(-1)", "page up", show=False),
        Binding("pagedown", "page(1)", "page down", show=False),
        Binding("g,home", "top", "top", tooltip="first line"),
        Binding("G,end", "bottom", "bottom", tooltip="last line; autoscroll on"),
        Binding("n", "next_match(1)", "next", tooltip="next match of the search"),
        Binding("N", "next_match(-1)", "previous", tooltip="previous match of the search"),
        Binding("y", "copy", "copy line", tooltip="copy the cursor line to the clipboard (OSC 52)"),
    ]

    auto_scroll: reactive[bool] = reactive(True)
    wrap: reactive[bool] = reactive(False)
    status: reactive[str] = reactive("idle", layout=False)      # idle | starting | following | dropped
    search: reactive[str | None] = reactive(None, layout=False)

    def __init__(self, **kw):
        super().__init__(**kw)
        self.lines: list[tuple[str, str | None, int]] = []      # text, kind (None|note|bad), updates
        self.cursor = 0
        self.shard: int | None = None
        self._rows: list[tuple[int, int, int]] | None = None   # (line, start, end) when wrapping
        self._width = 0

    # --- content --------------------------------------------------------------------------------

    def clear(self) -> None:
        self.lines.clear()
        self.cursor = 0
        self._changed()

    def write(self, text: str, kind: str | None = None) -> None:
        text = text.replace("\t", "    ").replace("\r", "")
        last = self.lines[-1] if self.lines else None
        if kind is None and last is not None and last[1] is None and any(c.isdigit() for c in text) \
                and shape(text) == shape(last[0]):
            self.lines[-1] = (text, None, last[2] + 1)          # a progress line updating in place
        else:
            self.lines.append((text, kind, 0))
            if len(self.lines) > MAX_LINES + 200:
                cut = len(self.lines) - MAX_LINES
                del self.lines[:cut]
                self.cursor = max(self.cursor - cut, 0)
        if self.auto_scroll:
            self.cursor = len(self.lines) - 1
        self._changed()

    def line_text(self, i: int) -> str:
        return self.lines[i][0] if 0 <= i < len(self.lines) else ""

    @property
    def plain_lines(self) -> list[str]:
        return [t for t, _, _ in self.lines]

    def _changed(self) -> None:
        self._rows = None
        self._update_size()
        if self.auto_scroll:
            self._scroll_to_cursor(bottom=True)
        self.refresh()

    # --- layout ---------------------------------------------------------------------------------
    def _visual_rows(self) -> list[tuple[int, int, int]]:
        width = max(self.scrollable_content_region.width, 1)
        if self._rows is None or self._width != width:
            self._width = width
            rows = []
            for i, (text, _, n) in enumerate(self.lines):
                full = folded(text, n)
                if not self.wrap or len(full) <= width:
                    rows.append((i, 0, len(full)))
                    continue
                for start in range(0, len(full), width):
                    rows.append((i, start, min(start + width, len(full))))
            self._rows = rows
        return self._rows

    def _update_size(self) -> None:
        rows = self._visual_rows()
        longest = 0 if self.wrap else max((cell_len(t) + 8 for t, _, _ in self.lines), default=0)
        self.virtual_size = Size(max(longest, self.size.width), len(rows))

    def on_resize(self) -> None:
        """Laid out anew (the first layout comes after a re-attached view has written the whole
        log): a log that follows its end shows its end, not wherever the first size left it."""
        self._rows = None
        self._update_size()
        if self.auto_scroll:
            self.call_after_refresh(self._scroll_to_cursor, True)

    def _row_of(self, line: int) -> int:
        for r, (i, _, _) in enumerate(self._visual_rows()):
            if i == line:
                return r
        return 0

    def _scroll_to_cursor(self, bottom: bool = False) -> None:
        height = max(self.scrollable_content_region.height, 1)
        if bottom:
            self.scroll_to(y=max(len(self._visual_rows()) - height, 0), animate=False)
            return
        row = self._row_of(self.cursor)
        top = int(self.scroll_offset.y)
        if row < top:
            self.scroll_to(y=row, animate=False)
        elif row >= top + height:
            self.scroll_to(y=row - height + 1, animate=False)

    def render_line(self, y: int) -> Strip:
        rows = self._visual_rows()
        width = self.scrollable_content_region.width
        r = int(self.scroll_offset.y) + y
        base = self.rich_style
        if r >= len(rows):
            return Strip.blank(width, base)
        i, start, end = rows[r]
        text, kind, n = self.lines[i]
        style = base
        if kind is not None:
            style = base + self.get_component_rich_style(f"logview--{kind}")
        if i == self.cursor and self.has_focus:
            style = style + self.get_component_rich_style("logview--cursor")
        full = folded(text, n)
        piece = full[start:end]
        segments = self._highlight(piece, style)
        strip = Strip(segments)
        if not self.wrap:
            x = int(self.scroll_offset.x)
            strip = strip.crop(x, x + width)
        return strip.adjust_cell_length(width, style)

    def _highlight(self, text: str, style: Style) -> list[Segment]:
        if not self.search:
            return [Segment(text, style)]
        match = self.get_component_rich_style("logview--match")
        out, pos = [], 0
        for m in re.finditer(re.escape(self.search), text, re.IGNORECASE):
            if m.start() == m.end():
                continue
            out.append(Segment(text[pos:m.start()], style))
            out.append(Segment(m.group(), style + match))
            pos = m.end()
        out.append(Segment(text[pos:], style))
        return out

    def watch_wrap(self) -> None:
        self._rows = None
        self._update_size()
        self._scroll_to_cursor()
        self.refresh()

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        self.refresh()

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    # --- keys -----------------------------------------------------------------------------------
    def _move(self, line: int) -> None:
        if not self.lines:
            return
        self.cursor = min(max(line, 0), len(self.lines) - 1)
        self.auto_scroll = self.cursor == len(self.lines) - 1 and self.auto_scroll
        self._scroll_to_cursor()
        self.refresh()

    def action_cursor(self, step: int) -> None:
        if step < 0:
            self.auto_scroll = False
        self._move(self.cursor + step)

    def action_page(self, step: int) -> None:
        self.auto_scroll = False
        self._move(self.cursor + step * max(self.scrollable_content_region.height - 1, 1))

    def action_top(self) -> None:
        self.auto_scroll = False
        self._move(0)

    def action_bottom(self) -> None:
        self.auto_scroll = True
        self._move(len(self.lines) - 1)
        self._scroll_to_cursor(bottom=True)

    def find(self, term: str | None, direction: int = 1, from_line: int | None = None) -> bool:
        """Move the cursor to the next line holding `term` (case-insensitive), wrapping around."""
        self.search = term or None
        self.refresh()
        if not self.search or not self.lines:
            return False
        needle = self.search.lower()
        n = len(self.lines)
        start = self.cursor if from_line is None else from_line
        for k in range(1, n + 1):
            i = (start + direction * k) % n
            if needle in self.lines[i][0].lower():
                self.auto_scroll = False
                self._move(i)
                return True
        return False

    def action_next_match(self, direction: int) -> None:
        if not self.search:
            self.app.notify("no search yet: / searches", severity="warning")
        elif not self.find(self.search, direction):
            self.app.notify(f"pattern not found: {self.search}", severity="warning")

    def action_copy(self) -> None:
        text = self.line_text(self.cursor)
        self.app.copy_to_clipboard(text)
        self.app.notify(f"copied: {text[:60]}" if text else "nothing to copy")

    # --- following --------------------------------------------------------------------------------
    def follow(self, source, shard: int | None) -> None:
        """Follow `shard`'s log (None: stop); following another shard cancels the last stream."""
        if shard == self.shard and self.status != "idle":
            return
        self.shard = shard
        self.clear()
        if shard is None:
            self.workers.cancel_group(self, "follow")
            self.status = "idle"
            return
        self.status = "starting"
        self.write(f"— log of shard {shard} —", "note")
        self.run_worker(self._follow(source, shard), exclusive=True, group="follow")

    async def _follow(self, source, shard: int) -> None:
        dropped = False
        while True:
            try:
                async for line in source.follow_log(shard):
                    if dropped:
                        self.write(f"— stream back at {time.strftime('%H:%M:%S')} —", "note")
                        dropped = False
                    self.status = "following"
                    self.write(line)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if not dropped:
                    self.write(f"— stream dropped at {time.strftime('%H:%M:%S')}: {e} — retrying", "bad")
                dropped = True
                self.status = "dropped"
            await asyncio.sleep(2)
