"""A table drawn line by line (Textual's Line API), laid out for the width it has.

Why not DataTable: the shard table must choose its columns by the terminal's width (id, state,
progress, rate first; the reason gets what is left, cut with an ellipsis), keep id and state on
screen (there is no horizontal scroll at all), mark the sort column in its header and redraw 512
rows every 1.5 s within a few per cent of a core. DataTable lays out every row and re-renders every
visible cell when one changes; this builds the cells of the rows in view only (`set_rows` takes
the order of every row and a function that makes one row's cells), and draws each line from a
cache keyed by its cells, so an unchanged row costs a dictionary lookup.

Cells are `str` or a tuple of (text, style) spans. Keys: up/down/page up/page down/home/end;
mouse: click selects a row, double click activates it, a click on the header sorts by that column.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Union

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widgets import Static

Span = tuple[str, Union[Style, str, None]]
Cell = Union[str, tuple[Span, ...]]


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    width: int                   # cells (the minimum, for the flex column)
    priority: int                # lower is kept first when the width runs out
    align: str = "left"          # left | right
    flex: bool = False           # takes the width that is left
    sort: bool = True            # may be sorted by


def fit_columns(columns: list[Column], width: int, flex_min: int = 8) -> list[tuple[Column, int]]:
    """The columns that fit `width` (one space between columns), taken in priority order until one
    does not fit, and shown in their given order. The flex column (the reason) takes what is left: columns less important
    than it are added only while it keeps its own width; more important ones may cut it down to
    `flex_min`."""
    flex = next((c for c in columns if c.flex), None)
    chosen: list[Column] = []
    used = 0                                   # the flex column counted at flex_min
    for col in sorted(columns, key=lambda c: c.priority):
        need = (flex_min if col.flex else col.width) + (1 if chosen else 0)
        keep = flex.width - flex_min if flex is not None and flex in chosen and col.priority > flex.priority else 0
        if used + need + keep > width:
            break                              # strictly by priority: nothing less important after
        chosen.append(col)
        used += need
    spare = max(width - used, 0)
    out = []
    for c in columns:
        if c in chosen:
            out.append((c, flex_min + spare if c.flex else c.width))
    if (flex is None or flex not in chosen) and out:   # no flex column on screen: the last one gets the rest
        c, w = out[-1]
        out[-1] = (c, w + spare)
    return out


class Rest(tuple):
    """A cell (its spans) that takes the rest of its row: the columns after it are not drawn (an
    unreachable host's reason, which one column cut at any width)."""


def _spans(cell: Cell) -> tuple[Span, ...]:
    return ((cell, None),) if isinstance(cell, str) else cell


def cell_text(cell: Cell) -> str:
    """The plain text of a cell (what tests and search read)."""
    return "".join(t for t, _ in _spans(cell))


def on_bar(style: Style, chip: Style | None = None) -> Style:
    """A cell's style on the selection bar: its weight and its own background (FATAL's badge)
    kept, its text colour dropped for the bar's, which was chosen to read on it (green on the
    bar's blue was 2.2:1) — or, in a column that keeps its colour (`chip`: the table's own
    background), its colour on a chip of the table's background, as it reads off the bar."""
    if style.bgcolor is not None:
        return style
    plain = Style(bold=style.bold, italic=style.italic, underline=style.underline, reverse=style.reverse)
    if chip is not None and style.color is not None and chip.bgcolor is not None:
        return plain + Style(color=style.color, bgcolor=chip.bgcolor)
    return plain


def render_cell(cell: Cell, width: int, align: str, base: Style, bar: bool = False,
                chip: Style | None = None) -> list[Segment]:
    """A cell cut (with an ellipsis) or padded to exactly `width` cells (`bar`: on the selection
    bar, its text in the bar's colour, or in its own on a `chip`: see on_bar)."""
    spans = _spans(cell)
    total = sum(cell_len(t) for t, _ in spans)
    segments: list[Segment] = []
    if total > width:                       # cut, keeping the left, marking the cut
        room, out = max(width - 1, 0), []
        for text, style in spans:
            if room <= 0:
                break
            n = cell_len(text)
            piece = text if n <= room else set_cell_size(text, room)
            out.append((piece, style))
            room -= cell_len(piece)
        spans, total = tuple(out) + (("…" if width else "", None),), width
    pad = " " * (width - total)
    if align == "right" and pad:
        segments.append(Segment(pad, base))
    for text, style in spans:
        own = (Style.parse(style) if isinstance(style, str) else style) if style else None
        st = base + (on_bar(own, chip) if bar else own) if own else base
        segments.append(Segment(text, st))
    if align != "right" and pad:
        segments.append(Segment(pad, base))
    return segments


_shown: weakref.WeakKeyDictionary[Static, object] = weakref.WeakKeyDictionary()   # what each Static says


def show_text(widget: Static, content) -> None:
    """Update a Static only when what it says changed, and without laying the screen out again when
    its height is fixed: at 512 shards a layout costs more than the redraw itself."""
    if _shown.get(widget) != content:
        _shown[widget] = content
        height = widget.styles.height
        widget.update(content, layout=height is None or height.is_auto)   # a fixed height: no layout


class LineTable(ScrollView, can_focus=True):
    COMPONENT_CLASSES = {"linetable--header", "linetable--cursor", "linetable--highlight"}
    BINDINGS = [
        Binding("up,k", "cursor(-1)", "up", show=False),
        Binding("down,j", "cursor(1)", "down", show=False),
        Binding("pageup", "page(-1)", "page up", show=False),
        Binding("pagedown", "page(1)", "page down", show=False),
        Binding("home", "edge(0)", "first", show=False),
        Binding("end", "edge(1)", "last", show=False),
    ]

    cursor_row: reactive[int] = reactive(0, always_update=False)
    coloured_on_bar: frozenset[str] = frozenset()     # columns whose colour the selection bar keeps (on a chip)

    class CursorMoved(Message):
        def __init__(self, table: "LineTable", key: str | None):
            super().__init__()
            self.table, self.key = table, key

        @property
        def control(self) -> "LineTable":
            return self.table

    class HeaderClicked(CursorMoved):
        def __init__(self, table: "LineTable", column: str):
            super().__init__(table, None)
            self.column = column

    class RowActivated(CursorMoved):
        """A row was double-clicked."""

    def __init__(self, columns: list[Column], **kw):
        super().__init__(**kw)
        self.columns = columns
        self.keys: list[str] = []
        self._make: Callable[[str], tuple[Cell, ...]] = lambda key: ()
        self._cells: dict[str, tuple[Cell, ...]] = {}      # this drawing's rows, made when shown
        self.highlight: set[str] = set()
        self.sort_column: str | None = None
        self.sort_reverse = False
        self.empty_text = ""
        self._layout: tuple[int, list[tuple[Column, int]]] | None = None
        self._strips: dict[tuple, Strip] = {}
        self.lines_built = 0                  # counted for the benchmark

    # --- data -----------------------------------------------------------------------------------
    @property
    def row_count(self) -> int:
        return len(self.keys)

    @property
    def selected_key(self) -> str | None:
        return self.keys[self.cursor_row] if 0 <= self.cursor_row < len(self.keys) else None

    def set_rows(self, keys: list[str], make: Callable[[str], tuple[Cell, ...]],
                 highlight: Iterable[str] = ()) -> None:
        """Show `keys` in this order, `make(key)` giving a row's cells when it is on screen; the
        cursor stays on its row's key where it still exists."""
        keep = self.selected_key
        self.keys, self._make, self._cells, self.highlight = keys, make, {}, set(highlight)
        if len(self._strips) > 1024:
            self._strips.clear()              # bounded: rows come and go
        index = {k: i for i, k in enumerate(keys)}
        row = index.get(keep, min(self.cursor_row, max(len(keys) - 1, 0))) if keep is not None \
            else min(self.cursor_row, max(len(keys) - 1, 0))
        if self.virtual_size.height != len(keys) + 1:
            self.virtual_size = Size(self.size.width, len(keys) + 1)
            if self.styles.height is not None and self.styles.height.is_auto:
                self.refresh(layout=True)       # a pane sized by its rows grows or shrinks
        if row != self.cursor_row:
            self.cursor_row = row
        else:
            self.refresh()

    def cells_of(self, key: str) -> tuple[Cell, ...]:
        cells = self._cells.get(key)
        if cells is None:
            cells = self._cells[key] = self._make(key)
        return cells

    def key_at(self, row: int) -> str | None:
        return self.keys[row] if 0 <= row < len(self.keys) else None

    def move_to_key(self, key: str) -> None:
        if key in self.keys:
            self.cursor_row = self.keys.index(key)

    # --- layout and drawing -----------------------------------------------------------------------
    def layout_for(self, width: int) -> list[tuple[Column, int]]:
        if self._layout is None or self._layout[0] != width:
            self._layout = (width, fit_columns(self.columns, width))
            self._strips.clear()
        return self._layout[1]

    def visible_columns(self) -> list[str]:
        return [c.key for c, _ in self.layout_for(self._width())]

    def _width(self) -> int:
        return max(self.scrollable_content_region.width, 1)

    def on_resize(self) -> None:
        """A new height keeps the cached lines (layout_for drops them when the width changes)."""
        self.virtual_size = Size(self.size.width, len(self.keys) + 1)
        self._scroll_cursor_into_view()

    def render_line(self, y: int) -> Strip:
        width = self._width()
        layout = self.layout_for(width)
        if y == 0:
            return self._header(layout, width)
        row = int(self.scroll_offset.y) + y - 1
        if row >= len(self.keys):
            if row == 0 and self.empty_text:
                return Strip([Segment(set_cell_size(self.empty_text, width), self.rich_style)])
            return Strip.blank(width, self.rich_style)
        key = self.keys[row]
        cursor = row == self.cursor_row
        mark = "c" if cursor and self.has_focus else "C" if cursor else "h" if key in self.highlight else ""
        cells = self.cells_of(key)
        cache_key = (key, cells, mark, width)
        strip = self._strips.get(cache_key)
        if strip is None:
            strip = self._row(cells, layout, width, mark)
            self._strips[cache_key] = strip
            self.lines_built += 1
        return strip

    def _row(self, cells: tuple[Cell, ...], layout, width: int, mark: str) -> Strip:
        base = self.rich_style
        if mark in ("c", "C"):
            base = base + self.get_component_rich_style("linetable--cursor")
            if mark == "C":
                base = base + Style(bold=False)
        elif mark == "h":
            base = base + self.get_component_rich_style("linetable--highlight")
        index = {c.key: i for i, c in enumerate(self.columns)}
        segments: list[Segment] = []
        for n, (col, w) in enumerate(layout):
            if n:
                segments.append(Segment(" ", base))
            i = index[col.key]
            cell = cells[i] if i < len(cells) else ""
            if isinstance(cell, Rest):
                w += sum(rest + 1 for _, rest in layout[n + 1:])
            segments += render_cell(cell, w, col.align, base, mark in ("c", "C"),
                                    self.rich_style if col.key in self.coloured_on_bar else None)
            if isinstance(cell, Rest):
                break
        return Strip(segments).adjust_cell_length(width, base)

    def _header(self, layout, width: int) -> Strip:
        base = self.rich_style + self.get_component_rich_style("linetable--header")
        segments: list[Segment] = []
        for n, (col, w) in enumerate(layout):
            if n:
                segments.append(Segment(" ", base))
            label = col.label
            if col.key == self.sort_column:
                label += "▼" if self.sort_reverse else "▲"
            segments += render_cell(label, w, col.align, base)
        return Strip(segments).adjust_cell_length(width, base)

    def column_at(self, x: int) -> str | None:
        pos = 0
        for n, (col, w) in enumerate(self.layout_for(self._width())):
            start = pos + (1 if n else 0)
            if start <= x < start + w:
                return col.key
            pos = start + w
        return None

    # --- cursor ---------------------------------------------------------------------------------
    def watch_cursor_row(self, old: int, new: int) -> None:
        self._scroll_cursor_into_view()
        self.refresh()
        self.post_message(self.CursorMoved(self, self.selected_key))

    def _page(self) -> int:
        return max(self.scrollable_content_region.height - 1, 1)

    def _scroll_cursor_into_view(self) -> None:
        top = int(self.scroll_offset.y)
        page = self._page()
        if self.cursor_row < top:
            self.scroll_to(y=self.cursor_row, animate=False)
        elif self.cursor_row >= top + page:
            self.scroll_to(y=self.cursor_row - page + 1, animate=False)

    def action_cursor(self, step: int) -> None:
        if self.keys:
            self.cursor_row = min(max(self.cursor_row + step, 0), len(self.keys) - 1)

    def action_page(self, step: int) -> None:
        self.action_cursor(step * self._page())

    def action_edge(self, end: int) -> None:
        if self.keys:
            self.cursor_row = len(self.keys) - 1 if end else 0

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        self.refresh()

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        if offset is None:
            return
        if offset.y == 0:
            column = self.column_at(offset.x)
            if column is not None:
                self.post_message(self.HeaderClicked(self, column))
            return
        row = int(self.scroll_offset.y) + offset.y - 1
        if 0 <= row < len(self.keys):
            self.cursor_row = row
            if event.chain >= 2:
                self.post_message(self.RowActivated(self, self.keys[row]))
