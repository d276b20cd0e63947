"""Contrast of every state badge (issue 25): WCAG 2 contrast ratio of the text against what is
behind it, as the live view draws it — the table's row renderer, the style module's colours and
the stylesheet's selection bar, ANSI colour names turned into RGB by Textual's own filter and the
app's ANSI theme — on a plain row, on the focused selection bar and on the blurred one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from rich.style import Style
from textual.filter import ANSIToTruecolor

from bench.synthetic_fleet import SyntheticFleet
from fleet.state import State
from fleet.tui.app import FleetApp
from fleet.tui.panes.lines import cell_text
from fleet.tui.panes.shards import COLUMN_KEYS, ShardTable, state_cell
from tests.fleet.tui_wait import drawn

AA = 4.5


def luminance(rgb) -> float:
    def channel(v: int) -> float:
        v /= 255
        return v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4
    r, g, b = rgb
    return 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b)


def contrast(a, b) -> float:
    hi, lo = sorted((luminance(a), luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def test_contrast_formula_matches_wcag():
    assert round(contrast((255, 255, 255), (0, 0, 0)), 1) == 21.0
    assert round(contrast((118, 118, 118), (255, 255, 255)), 2) == 4.54       # WCAG's AA grey


def badge_contrasts(app: FleetApp, table: ShardTable, mark: str) -> dict[str, float]:
    """Each state's badge as the table draws it in a row (`mark`: "" plain, "c" the focused
    selection bar, "C" the blurred one): the lowest contrast of its text's segments."""
    to_rgb = ANSIToTruecolor(app.ansi_theme)
    key = table.keys[0]
    layout = table.layout_for(table.size.width)
    out = {}
    for state in State:
        cells = list(table.cells_of(key))
        cells[COLUMN_KEYS.index("state")] = state_cell_for(state)
        strip = table._row(tuple(cells), layout, table.size.width, mark)
        label = state.value
        worst = None
        for seg in strip:
            if not seg.text.strip() or seg.text.strip() not in f"{cell_text(state_cell_for(state))}":
                continue
            style = to_rgb.truecolor_style(seg.style or Style(), None)
            fg = style.color.get_truecolor() if style.color else None
            bg = style.bgcolor.get_truecolor() if style.bgcolor else None
            assert fg is not None and bg is not None, (state, mark, seg)
            c = contrast(fg, bg)
            worst = c if worst is None else min(worst, c)
        assert worst is not None, (label, mark)
        out[label] = round(worst, 2)
    return out


def state_cell_for(state: State):
    return state_cell(SimpleNamespace(state=state, backoff_s=None), False, False)


@pytest.mark.parametrize("mark", ["", "c", "C"], ids=["row", "selection-bar", "selection-bar-blurred"])
async def test_every_state_badge_reads_at_4_5_to_1(mark):
    app = FleetApp(SyntheticFleet(hosts=1, gpus=2, seed=1), interval=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(pilot, app)
        table = app.main.query_one(ShardTable)
        if mark == "C":
            await pilot.press("tab")                         # the bar as it looks without the focus
            assert not table.has_focus
        ratios = badge_contrasts(app, table, mark)
        low = {k: v for k, v in ratios.items() if v < AA}
        assert not low, f"under {AA}:1: {low} (all: {ratios})"
