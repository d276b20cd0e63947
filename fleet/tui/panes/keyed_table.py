"""A DataTable that takes rows by key and touches only what is on screen and changed."""

from __future__ import annotations

from typing import Callable

from textual.widgets import DataTable


def _width(value) -> int:
    return value.cell_len if hasattr(value, "cell_len") else len(str(value))


class KeyedTable(DataTable):
    """`sync(order, make_cells)`: `order` is the row keys in display order, `make_cells(key)` builds
    a row's cells.

    Same keys in the same order: only rows in view are rebuilt and only their changed cells written
    (no width recomputation unless a cell outgrows its column); rows out of view are marked stale
    and brought up to date when they scroll into view. Otherwise the table is rebuilt once, keeping
    the cursor on the same key where it still exists.
    """

    def __init__(self, columns: list[tuple[str, str]], **kw):
        super().__init__(cursor_type="row", zebra_stripes=False, **kw)
        self._columns = columns
        self._keys = [k for _, k in columns]
        self._shown: dict[str, tuple] = {}
        self._order: list[str] = []
        self._stale: set[str] = set()
        self._make: Callable[[str], tuple] | None = None
        self.cells_written = 0

    def on_mount(self) -> None:
        for label, key in self._columns:
            self.add_column(label, key=key)

    @property
    def selected_key(self) -> str | None:
        if not self._order or self.cursor_row < 0 or self.cursor_row >= len(self._order):
            return None
        return self._order[self.cursor_row]

    def sync(self, order: list[str], make_cells: Callable[[str], tuple]) -> int:
        """Returns the number of cells written (what the benchmark counts)."""
        before = self.cells_written
        self._make = make_cells
        if order == self._order:
            self._stale = set(order)
            self._update_in_view()
            return self.cells_written - before
        keep = self.selected_key
        self.clear()
        self._shown = {}
        for key in order:
            cells = make_cells(key)
            self.add_row(*cells, key=key)
            self._shown[key] = cells
            self.cells_written += len(cells)
        self._order, self._stale = order, set()
        if keep in self._shown:
            self.move_cursor(row=order.index(keep), animate=False)
        return self.cells_written - before

    def _update_in_view(self) -> None:
        if not self._stale or self._make is None:
            return
        top = max(int(self.scroll_y) - 1, 0)
        bottom = top + max(self.size.height, 1) + 2
        for key in self._order[top:bottom]:
            if key not in self._stale:
                continue
            self._stale.discard(key)
            cells, old = self._make(key), self._shown[key]
            for i, value in enumerate(cells):
                if value != old[i]:
                    grows = _width(value) > self.columns[self._keys[i]].content_width
                    self.update_cell(key, self._keys[i], value, update_width=grows)
                    self.cells_written += 1
            self._shown[key] = cells

    def watch_scroll_y(self, old: float, new: float) -> None:
        super().watch_scroll_y(old, new)
        self._update_in_view()
