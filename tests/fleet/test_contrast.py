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
from tests.fleet.tui_wait import drawn, until

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


def badge_contrasts(app: FleetApp, table: ShardTable, mark: str, measure=None) -> dict[str, float]:
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
            c = (measure or contrast)(fg, bg)
            worst = c if worst is None else min(worst, c)
        assert worst is not None, (label, mark)
        out[label] = round(worst, 2)
    return out


def state_cell_for(state: State):
    return state_cell(SimpleNamespace(state=state, backoff_s=None), False, False)


@pytest.mark.parametrize("colours", ["truecolor", "256"])
@pytest.mark.parametrize("mark", ["", "c", "C"], ids=["row", "selection-bar", "selection-bar-blurred"])
async def test_every_state_badge_reads_at_4_5_to_1(mark, colours):
    """In truecolor and in the 256 colours tmux sends by default (issue 55)."""
    app = FleetApp(SyntheticFleet(hosts=1, gpus=2, seed=1), interval=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(pilot, app)
        table = app.main.query_one(ShardTable)
        if mark == "C":
            await pilot.press("tab")                         # the bar as it looks without the focus
            assert not table.has_focus
        ratios = badge_contrasts(app, table, mark, contrast_256 if colours == "256" else contrast)
        low = {k: v for k, v in ratios.items() if v < AA}
        assert not low, f"under {AA}:1 in {colours}: {low} (all: {ratios})"


# --- 256 colours (tmux's default): every state, the alerts, the finished banner, the dialogs ----

def palette(rgb) -> tuple[int, int, int]:
    """A colour as a 256-colour terminal shows it: Textual's truecolor, downgraded to the xterm
    palette (what a terminal without truecolor, tmux by default, is sent)."""
    from rich.color import Color, ColorSystem
    return Color.from_rgb(*rgb).downgrade(ColorSystem.EIGHT_BIT).get_truecolor()


def worst_on_screen(app: FleetApp, needle: str) -> float | None:
    """The lowest contrast, in 256 colours, of the screen's segments that are part of `needle`
    (on the rows that hold it), as the compositor draws them."""
    to_rgb = ANSIToTruecolor(app.ansi_theme)
    worst = None
    for strip in app.screen._compositor.render_strips():
        if needle not in "".join(seg.text for seg in strip):
            continue
        for seg in strip:
            if not seg.text.strip() or seg.text.strip() not in needle:
                continue
            style = to_rgb.truecolor_style(seg.style or Style(), None)
            fg, bg = style.color, style.bgcolor
            if style.reverse:
                fg, bg = bg, fg
            assert fg is not None and bg is not None, (needle, seg)
            c = contrast_256(fg.get_truecolor(), bg.get_truecolor())
            worst = c if worst is None else min(worst, c)
    return worst


def contrast_256(a, b) -> float:
    return contrast(palette(a), palette(b))


@pytest.mark.parametrize("level", ["low", "critical"])
async def test_the_alert_the_finished_banner_and_the_dialogs_read_at_4_5_to_1_in_256_colours(level):
    """Issue 55 measured under tmux's 256 colours: the critical alert 4.40:1, the finished line
    4.19:1, the dialog buttons ~3.5:1."""
    from fleet.config import ExpectedSpec
    f = SyntheticFleet(hosts=1, gpus=2, seed=1)
    f.expected = ExpectedSpec(samples_per_s_per_gpu=8 if level == "low" else 40, alert_ratio=0.8)
    app = FleetApp(f, interval=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(pilot, app)
        assert app.snap.totals.alert_level == level
        share = f"{app.snap.totals.ratio:.0%} of expected"
        assert worst_on_screen(app, share) >= AA, share
        await pilot.press("r")
        await until(pilot, lambda: app.screen.query("#question"), what="the dialog")
        for label in ("Restart (y)", "Cancel (enter, n, esc)"):
            assert worst_on_screen(app, label) >= AA, (label, worst_on_screen(app, label))
        await pilot.press("n")
    f = SyntheticFleet(hosts=1, gpus=2, seed=1)
    f.finish(list(range(2)))
    app = FleetApp(f, interval=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(pilot, app)
        assert app.snap.totals.finished
        assert worst_on_screen(app, "→ fleet verify") >= AA


async def test_the_selected_row_keeps_its_state_colour():
    """Issue 55: on the selection bar a row's state lost its colour (the bar's text colour was
    taken for contrast). The state column keeps its colour, on a chip of the table's background."""
    app = FleetApp(SyntheticFleet(hosts=1, gpus=2, seed=1), interval=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(pilot, app)
        table = app.main.query_one(ShardTable)
        layout = table.layout_for(table.size.width)
        cells = list(table.cells_of(table.keys[0]))
        for state in (State.RUNNING, State.LATE, State.FAILED, State.BACKOFF):
            cells[COLUMN_KEYS.index("state")] = state_cell_for(state)
            colours = {}
            for mark in ("", "c"):
                strip = table._row(tuple(cells), layout, table.size.width, mark)
                seg = next(s for s in strip if state.value in s.text)
                colours[mark] = (seg.style.color, seg.style.bgcolor)
            assert colours["c"] == colours[""], (state, colours)
