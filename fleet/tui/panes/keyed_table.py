"""A DataTable that takes whole rows by key and touches only the cells that changed."""

from __future__ import annotations

from textual.widgets import DataTable


def _width(value) -> int:
    return value.cell_len if hasattr(value, "cell_len") else len(str(value))


class KeyedTable(DataTable):
    """`sync(rows)` with rows as {key: tuple of cells}, in display order.

    Same keys in the same order: only changed cells are updated (no width recomputation). Otherwise
    the table is rebuilt once, keeping the cursor on the same key where it still exists.
    """

    def __init__(self, columns: list[tuple[str, str]], **kw):
        super().__init__(cursor_type="row", zebra_stripes=True, **kw)
        self._columns = columns
        self._rows: dict[str, tuple] = {}
        self._order: list[str] = []

    def on_mount(self) -> None:
        for label, key in self._columns:
            self.add_column(label, key=key)

    @property
    def selected_key(self) -> str | None:
        if not self._order or self.cursor_row < 0 or self.cursor_row >= len(self._order):
            return None
        return self._order[self.cursor_row]

    def sync(self, rows: dict[str, tuple]) -> int:
        """Returns the number of cells written (what the benchmark counts)."""
        order = list(rows)
        written = 0
        if order == self._order:
            keys = [k for _, k in self._columns]
            for key, cells in rows.items():
                old = self._rows[key]
                for i, value in enumerate(cells):
                    if value != old[i]:
                        grows = _width(value) > self.columns[keys[i]].content_width
                        self.update_cell(key, keys[i], value, update_width=grows)
                        written += 1
            self._rows = rows
            return written
        keep = self.selected_key
        self.clear()
        for key, cells in rows.items():
            self.add_row(*cells, key=key)
            written += len(cells)
        self._rows, self._order = rows, order
        if keep in rows:
            self.move_cursor(row=order.index(keep), animate=False)
        return written
