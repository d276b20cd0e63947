"""Every key and mouse action of the live view, with Textual's pilot on the synthetic fleet (real
records, the real judge and snapshot; events recorded from real runs): what each one changes on screen."""

from __future__ import annotations

import contextlib
import re

import pytest

from bench.synthetic_fleet import SyntheticFleet
from fleet.state import State
from fleet.tui.app import FleetApp, QUIT_MESSAGE
from fleet.tui.commands import CommandError, parse
from fleet.tui.main import MainScreen
from fleet.tui.panes.gpus import GpuTable
from fleet.tui.panes.lines import cell_text, fit_columns
from fleet.tui.panes.log import LogView, shape
from fleet.tui.panes.shards import COLUMN_KEYS, COLUMNS, ShardDetail, ShardTable
from fleet.tui.app import help_text
from fleet.tui.screens import ConfirmScreen, HelpScreen, LogScreen
from textual.widgets import Input
from textual.command import CommandPalette
from tests.fleet.tui_wait import drawn, redrawn, until


def fleet(**kw) -> SyntheticFleet:
    kw.setdefault("failed", (3,))
    kw.setdefault("backoff", (5,))
    f = SyntheticFleet(**{"hosts": 2, "gpus": 4, "seed": 1, **kw})
    for _ in range(5):
        f.tick(1.0)
    return f


def cell(table, row: str, column: str) -> str:
    return cell_text(table.cells_of(row)[COLUMN_KEYS.index(column)])


def question(app) -> str:
    return str(app.screen.query_one("#question").render())


async def started(app, size=(120, 40)):
    ctx = app.run_test(size=size)
    pilot = await ctx.__aenter__()
    await drawn(pilot, app)
    return ctx, pilot


@pytest.fixture
async def ui():
    f = fleet()
    app = FleetApp(f, interval=3600)            # keys redraw at once; actions ask for a snapshot
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(pilot, app)
        yield f, app, pilot, app.main.query_one(ShardTable)


async def test_space_marks_x_stops_marked_as_stopped_and_R_skips_them(ui):
    f, app, pilot, table = ui
    await pilot.press("space", "down", "space")                  # mark 0 and 1: the cursor stays
    assert app.main.view.marked == {0, 1} and table.selected_shard == 1
    assert cell(table, "0", "id").startswith("●")
    await pilot.press("x")
    assert "Stop shard(s) 0, 1?" in question(app)
    await pilot.press("y")
    await until(pilot, lambda: {s.state for s in app.snap.shards[:2]} == {State.STOPPED}, what="0 and 1 stopped")
    assert [(s.state, s.reason) for s in app.snap.shards[:2]] == [(State.STOPPED, "stopped")] * 2
    assert cell(table, "0", "state") == "■ STOPPED" and app.main.view.marked == set()
    await pilot.press("R")                                       # stopped shards are not failures
    assert "Restart 2 FAILED/BACKOFF/FATAL shard(s): 3, 5?" in question(app)
    await pilot.press("n")
    assert app.snap.shards[3].state == State.FATAL


async def test_space_marks_the_shard_the_detail_line_shows_after_tab_and_ctrl_p(ui):
    """Issue 25: after tab and the command palette, space marked shard 0 while the detail line
    showed shard 1. Whatever pane has the focus, space marks the selected shard, the cursor stays
    and the detail line says so; r then asks about exactly that shard."""
    f, app, pilot, table = ui
    detail = app.main.query_one("#detail")
    await pilot.press("down")
    assert table.selected_shard == 1 and str(detail.render()).startswith("shard 1 ")
    await pilot.press("tab")
    assert not table.has_focus
    await pilot.press("ctrl+p")
    await until(pilot, lambda: isinstance(app.screen, CommandPalette), what="the palette")
    await pilot.press("escape")
    await until(pilot, lambda: app.screen is app.main, what="the palette closed")
    await pilot.press("space")
    await until(pilot, lambda: app.main.view.marked == {1}, what="shard 1 marked")
    assert app.main.view.marked == {1} and table.selected_shard == 1
    assert str(detail.render()).startswith("● marked shard 1 ")
    await pilot.press("tab", "space")                            # another pane: the same shard
    assert app.main.view.marked == set() and str(detail.render()).startswith("shard 1 ")
    await pilot.press("space", "r")
    assert "Restart shard(s) 1?" in question(app)
    await pilot.press("n")


async def test_r_restarts_the_selected_shard_after_asking(ui):
    f, app, pilot, table = ui
    table.move_to_key("3")
    await until(pilot, lambda: table.selected_shard == 3, what="shard 3 selected")
    await pilot.press("r")
    assert "Restart shard(s) 3?" in question(app)
    await pilot.press("y")
    await until(pilot, lambda: app.snap.shards[3].state != State.FATAL, what="shard 3 relaunched")
    assert app.snap.shards[3].state == State.STARTING and f.shards[3][2].launches == 2   # until it loads
    f.tick(60.0)                                                 # the recorded launch loads, runs a batch
    await redrawn(pilot, app)
    assert app.snap.shards[3].state == State.RUNNING


async def test_D_stops_the_whole_run_after_asking(ui):
    f, app, pilot, table = ui
    await pilot.press("D")
    assert "Stop the WHOLE run" in question(app)
    await pilot.press("escape")                                  # no
    assert app.snap.shards[0].state == State.RUNNING
    await pilot.press("D", "y")                                  # y is not the run's key: still asking
    assert isinstance(app.screen, ConfirmScreen) and app.snap.shards[0].state == State.RUNNING
    assert "D stop the run" in question(app)
    await pilot.press("D")
    await until(pilot, lambda: app.snap.shards[0].state == State.STOPPED, what="the run stopped")
    assert {s.state for s in app.snap.shards} == {State.STOPPED, State.FATAL, State.BACKOFF}


async def test_enter_cancels_every_destructive_question_and_jk_move(ui):
    """Issue 55: the dialogs open on Cancel, so Enter (a k9s or vim user's "open") stops nothing;
    j and k move the cursor, as in k9s and vim; stop is x."""
    f, app, pilot, table = ui
    await pilot.press("j")
    assert table.selected_shard == 1
    await pilot.press("k")
    assert table.selected_shard == 0 and app.screen is app.main         # k moved: nothing asked
    for keys in (("x",), ("r",), ("D",)):
        await pilot.press(*keys)
        assert isinstance(app.screen, ConfirmScreen)
        assert app.screen.focused is not None and app.screen.focused.id == "no"
        await pilot.press("enter")
        await until(pilot, lambda: app.screen is app.main, what=f"{keys} cancelled")
    await redrawn(pilot, app)
    assert app.snap.shards[0].state == State.RUNNING and f.shards[0][2].launches == 1


def burst(app, text: str) -> None:
    """Keys as a terminal delivers a burst: all in the app's queue before it reads the first (the
    pilot's press() waits for each key to be handled, which hid issue 55's bug)."""
    from textual import events
    from textual.keys import _character_to_key
    for ch in text:
        app.post_message(events.Key(_character_to_key(ch), ch))


async def test_keys_typed_in_one_burst_after_slash_and_colon_go_to_the_input(ui):
    """Issue 55: `/local:0` typed in one burst opened the log (`l`) or put the `/` in the filter;
    `/ry` opened the restart dialog and confirmed it. Every key after `/` or `:` is the input's,
    `/` and `:` typed inside an input are its characters."""
    f, app, pilot, table = ui
    burst(app, "/ryl:kx/")
    await until(pilot, lambda: app.main.query_one("#filter", Input).value == "ryl:kx/", what="the burst in the filter")
    assert app.screen is app.main
    await pilot.press("escape")
    burst(app, ":log 1")
    await until(pilot, lambda: app.main.query_one("#command", Input).value == "log 1", what="the command")
    assert app.screen is app.main
    await pilot.press("escape")
    await redrawn(pilot, app)
    assert {s.state for s in app.snap.shards[:3]} == {State.RUNNING}
    await pilot.press("l")                                         # the log view's own / and its burst
    await until(pilot, lambda: isinstance(app.screen, LogScreen), what="the log view")
    burst(app, "/shard 0")
    await until(pilot, lambda: app.screen.query_one("#log-search", Input).value == "shard 0", what="the search")


async def test_slash_filters_live_as_typed_regex_and_negation_escape_clears(ui):
    f, app, pilot, table = ui
    await pilot.press("slash", *"box01")
    assert table.row_count == 4                                  # no enter needed
    await pilot.press(*":[13]")
    assert table.keys == ["5", "7"]
    await pilot.press("enter")
    assert not app.main.query_one("#filter").display and table.has_focus
    await pilot.press("slash", *"!box01:[13]", "enter")        # typing replaces the last filter
    assert app.main.view.query == "!box01:[13]" and len(table.keys) == 6
    await pilot.press("slash", "left_square_bracket", "enter")   # a bad regex is taken literally
    assert table.row_count == 0 and "no shard matches" in table.empty_text
    await pilot.press("escape")
    assert table.row_count == 8 and app.main.view.query == ""


async def test_f_shows_only_faulty_shards(ui):
    f, app, pilot, table = ui
    await pilot.press("f")
    assert table.keys == ["3", "5"] and "faulty only" in str(app.main.query_one("#shards-title").render())
    await pilot.press("f")
    assert table.row_count == 8


async def test_sort_keys_marker_reverse_number_keys_and_header_click(ui):
    f, app, pilot, table = ui
    await pilot.press("s")                                       # next column after shard: host:gpu
    assert app.main.view.sort == table.visible_columns()[1]
    await pilot.press("3")                                       # the third column on screen: state
    assert app.main.view.sort == "state" and table.keys[0] == "3"      # FATAL first
    assert "state▲" in table.render_line(0).text
    await pilot.press("3")                                       # again: reversed
    assert app.main.view.reverse and table.keys[-1] == "3" and "state▼" in table.render_line(0).text
    await pilot.press("S")
    assert not app.main.view.reverse
    x = table.render_line(0).text.index("tok/s")
    await pilot.click(ShardTable, offset=(x + 1, 0))             # a header click sorts by it
    assert app.main.view.sort == "tps"
    rates = [app.snap.shards[int(k)].tokens_per_s for k in table.keys]
    measured = [r for r in rates if r is not None]
    assert measured == sorted(measured) and rates[-2:] == [None, None]   # unmeasured stay last
    await pilot.click(ShardTable, offset=(x + 1, 0))
    assert app.main.view.reverse
    rates = [app.snap.shards[int(k)].tokens_per_s for k in table.keys]
    assert [r for r in rates if r is not None] == sorted(measured, reverse=True) and rates[-1] is None


async def test_enter_l_and_double_click_open_the_log_with_its_own_keys(ui):
    f, app, pilot, table = ui
    table.move_to_key("2")
    await pilot.press("enter")
    assert isinstance(app.screen, LogScreen) and app.screen.shard == 2
    view = app.screen.query_one(LogView)
    await until(pilot, lambda: len(view.lines) == 3, what="the log read")
    # 30 progress lines of one loop collapse into one updating line; the warning stays its own.
    assert len(view.lines) == 3 and view.lines[1][2] == 29 and "done=1015" in view.lines[1][0]
    # Main-screen keys do not leak: l, f, / and : act on the log (or not at all), not the shards.
    await pilot.press("l", "f", "r")
    assert isinstance(app.screen, LogScreen) and len(app.screen_stack) == 2 and not app.main.view.faulty_only
    await pilot.press("escape")
    assert isinstance(app.screen, MainScreen)
    await pilot.press("l")
    assert app.screen.shard == 2
    await pilot.press("q")                                       # q leaves the log, like less
    assert isinstance(app.screen, MainScreen)
    await pilot.pause()                                         # the main screen laid out again
    under = int(table.keys[int(table.scroll_y) + 3])             # the 4th row shown (line 0: header)
    await pilot.click(ShardTable, offset=(3, 4), times=2)        # double click on it
    assert isinstance(app.screen, LogScreen) and app.screen.shard == under


async def test_log_view_search_n_N_g_G_copy_autoscroll_and_wrap():
    f = fleet(log_lines=3)
    app = FleetApp(f, interval=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await drawn(pilot, app)
        app.push_screen(LogScreen(f, 0))
        await until(pilot, lambda: isinstance(app.screen, LogScreen) and app.screen.query(LogView), what="the log screen")
        view = app.screen.query_one(LogView)
        for i in range(40):
            view.write(f"step {i} {'ERROR disk' if i in (7, 30) else 'ok'}")
        view.write("x" * 200)
        assert view.cursor == len(view.lines) - 1                # autoscroll follows the end
        await pilot.press("g")
        assert view.cursor == 0 and not view.auto_scroll
        await pilot.press("slash", *"error")                     # incremental: jumps while typing
        assert "ERROR" in view.line_text(view.cursor) and "step 7" in view.line_text(view.cursor)
        await pilot.press("enter", "n")
        assert "step 30" in view.line_text(view.cursor)
        await pilot.press("n")                                   # wraps around
        assert "step 7" in view.line_text(view.cursor)
        await pilot.press("N")
        assert "step 30" in view.line_text(view.cursor)
        await pilot.press("y")
        assert app.clipboard == "step 30 ERROR disk"
        await pilot.press("g")
        assert "autoscroll off" in str(app.screen.query_one("#log-title").render())
        await pilot.press("G")
        assert view.cursor == len(view.lines) - 1 and view.auto_scroll
        title = str(app.screen.query_one("#log-title").render())   # the title says so at once
        assert "autoscroll on" in title and "search 'error'" in title and "starting" not in title, title
        rows = len(view._visual_rows())
        await pilot.press("w")
        assert view.wrap and len(view._visual_rows()) > rows       # the long line wraps
        await pilot.press("a")
        assert not view.auto_scroll
        assert "autoscroll off" in str(app.screen.query_one("#log-title").render())
        await pilot.press("escape")
        assert isinstance(app.screen, MainScreen)


async def test_colon_commands(ui):
    f, app, pilot, table = ui
    await pilot.press("colon", *"host box01", "enter")
    assert table.keys == ["4", "5", "6", "7"]
    await pilot.press("colon", *"state backoff,fatal", "enter")
    assert table.keys == ["5"]
    await pilot.press("colon", *"clear", "enter")
    assert table.row_count == 8
    await pilot.press("colon", *"sort -eta", "enter")
    assert (app.main.view.sort, app.main.view.reverse) == ("eta", True)
    await pilot.press("colon", *"restart 3,5", "enter")
    assert "Restart shard(s) 3, 5?" in question(app)
    await pilot.press("n")
    await pilot.press("colon", *"log 6", "enter")
    assert isinstance(app.screen, LogScreen) and app.screen.shard == 6
    await pilot.press("escape", "colon", *"frobnicate", "enter")
    assert isinstance(app.screen, MainScreen)


def test_command_parser_names_what_is_wrong():
    states = {0: "RUNNING", 1: "FATAL", 2: "BACKOFF", 3: "STOPPED"}
    known = set(states)
    p = lambda line: parse(line, known, states, {"box00"}, COLUMN_KEYS)
    assert p(":restart 0-2").shards == (0, 1, 2) and p("r failed").shards == (1, 2)
    assert p("stop 3").shards == (3,) and p("sort -tps").reverse and p("host").arg == ""
    for line, why in [("restart 9", "no shard 9"), ("restart x", "not a shard id"), ("log 0,1", "one shard"),
                      ("host box99", "no host 'box99'"), ("state sleepy", "no state 'SLEEPY'"),
                      ("sort colour", "no column 'colour'"), ("dance", "unknown command 'dance'")]:
        with pytest.raises(CommandError, match=why):
            p(line)


async def test_question_mark_help_is_generated_from_every_binding_and_never_wraps():
    app = FleetApp(fleet(), interval=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await drawn(pilot, app)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = help_text(app)
        for b in MainScreen.BINDINGS + LogScreen.BINDINGS + LogView.BINDINGS + GpuTable.BINDINGS:
            if b.tooltip and not b.action.startswith("sort_column"):
                assert b.tooltip in text, b
        for key in ("tab", "ctrl+p", "click a header", "1 … 9", "q / ^c", "y ", "n ", "N "):
            assert key in text, key
        plain = text.replace("[b]", "").replace("[/b]", "").replace("[i]", "").replace("[/i]", "")
        assert max(len(line) for line in plain.splitlines()) <= 76
        assert plain.splitlines()[0].startswith("esc, q or ? closes this help")   # first, at any height
        await pilot.press("question_mark")
        assert isinstance(app.screen, MainScreen)


async def test_q_and_ctrl_c_quit_with_a_message_true_to_what_is_left(ui):
    f, app, pilot, table = ui
    await pilot.press("ctrl+c")
    assert app.return_value.startswith(QUIT_MESSAGE)
    named = [s for s in f.snapshot().shards if s.state.value in ("FATAL", "STALLED", "FAILED")]
    assert named and all(f"shard {s.id} ({s.host}:{s.gpu})" in app.return_value for s in named)
    f2 = fleet(failed=(), backoff=())
    f2.finish()
    app2 = FleetApp(f2, interval=3600)
    async with app2.run_test(size=(100, 30)) as pilot2:
        await drawn(pilot2, app2)
        await pilot2.press("q")
    assert app2.return_value.startswith("fleet: run synthetic is finished: 8/8 shards DONE in")
    assert "fleet verify" in app2.return_value


async def test_tab_moves_between_panes_and_enter_expands_a_gpu_host():
    f = SyntheticFleet(hosts=6, gpus=8, seed=2)                  # 54 rows: hosts start folded
    app = FleetApp(f, interval=3600)
    async with app.run_test(size=(160, 50)) as pilot:
        await drawn(pilot, app)
        gpus = app.main.query_one(GpuTable)
        assert gpus.keys == [f"h:box0{i}" for i in range(6)]
        assert "h:box00" in gpus.highlight                       # the selected shard's host
        await pilot.press("tab")
        assert app.main.query_one("#log", LogView).has_focus
        await pilot.press("tab")
        assert gpus.has_focus
        await pilot.press("down", "enter")
        assert gpus.keys[:3] == ["h:box00", "h:box01", "g:box01:0"] and len(gpus.keys) == 14
        await pilot.press("enter")                               # folds again
        assert len(gpus.keys) == 6
        await pilot.press("tab")
        assert app.main.query_one(ShardTable).has_focus
        # Select shard 9 (box01 GPU 1): its host unfolds? no: the host row is highlighted.
        app.main.query_one(ShardTable).move_to_key("9")
        await until(pilot, lambda: gpus.highlight == {"h:box01"}, what="box01 highlighted")
        assert gpus.highlight == {"h:box01"}
        gpus.expanded.add("box01")
        app.main.redraw()
        assert gpus.highlight == {"g:box01:1"}


def counting_bells(source) -> tuple[FleetApp, list]:
    """The live view on `source`, with the bells it rings kept in the returned list."""
    bells: list = []

    class App(FleetApp):
        def bell(self):
            bells.append(1)
    return App(source, interval=3600), bells


async def test_a_failure_while_watching_is_toasted_with_the_bell():
    f = fleet()
    app, bells = counting_bells(f)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(pilot, app)
        assert bells == []                                       # failures before watching: silent
        f.kill(6)                                                # killed: a restart is due (BACKOFF)
        await redrawn(pilot, app)
        assert bells == [1]
        messages = [n.message for n in app._notifications]
        assert any("shard 6" in m and "RUNNING -> BACKOFF: killed by signal 9" in m for m in messages), messages
        await redrawn(pilot, app)
        assert bells == [1]                                      # told once


async def test_a_stall_is_toasted_with_the_bell_as_it_appears_labelled_stalled():
    """Issue 25: the STALLED toast came 13 s after STALLED showed, labelled "RUNNING -> STARTING".
    The frame that first shows a shard STALLED brings the toast and the bell, and says STALLED."""
    f = fleet()
    app, bells = counting_bells(f)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(pilot, app)
        f.stalled.add(7)                                          # alive, no more progress
        for _ in range(f.policy.stall_timeout - 5):
            f.tick(1.0)
        await redrawn(pilot, app)
        assert app.snap.shards[7].state == State.LATE and bells == []    # LATE: no toast, no bell yet
        assert cell(app.main.query_one(ShardTable), "7", "state") == "◷ LATE"
        for _ in range(10):
            f.tick(1.0)
        await redrawn(pilot, app)
        table = app.main.query_one(ShardTable)
        assert app.snap.shards[7].state == State.STALLED and cell(table, "7", "state").startswith("⚠ STALLED")
        assert bells == [1]                                       # in the same frame
        messages = [n.message for n in app._notifications]
        assert any("shard 7" in m and "LATE -> STALLED" in m for m in messages), messages
        assert not any("STARTING" in m for m in messages), messages


def test_columns_fit_the_width_by_priority_and_the_reason_takes_the_rest():
    keys = lambda w: [c.key for c, _ in fit_columns(COLUMNS, w)]
    assert keys(60) == ["id", "state", "progress", "tps", "reason"]
    assert keys(80) == ["id", "where", "state", "progress", "tps", "reason"]
    assert set(keys(220)) == set(COLUMN_KEYS)
    for width in (60, 80, 120, 220):
        widths = dict((c.key, w) for c, w in fit_columns(COLUMNS, width))
        assert sum(widths.values()) + len(widths) - 1 == width
        assert widths["reason"] >= (26 if width >= 80 else 8)
    assert shape("processed 812/1500 (3.2 it/s)") == shape("processed 813/1500 (3.4 it/s)")


@pytest.mark.parametrize("size", [(80, 24), (120, 40), (200, 60)])
async def test_a_toast_never_covers_the_selected_shards_detail_line_or_the_log(size):
    """At 80x24 the line under the table is the only place a shard's whole reason shows, and the
    log's newest line says what a toast says (issue 55: toasts covered the log for 8 s): a toast
    (a failure told while watching, a `:` command's error) sits elsewhere, at any height."""
    app = FleetApp(fleet(), interval=3600)
    async with app.run_test(size=size, notifications=True) as pilot:
        await drawn(pilot, app)
        await pilot.press("colon", *"bogus", "enter")              # an error toast, as a user gets it
        toasts = lambda: [w for w in app.screen.walk_children() if type(w).__name__ == "Toast" and w.region.area]
        await until(pilot, toasts, what="the error's toast")
        await pilot.pause()
        toasts = toasts()
        detail = app.screen.query_one(ShardDetail).region
        log = app.screen.query_one(LogView)
        assert toasts and all(t.region.area and not t.region.overlaps(detail) for t in toasts), \
            ([t.region for t in toasts], detail)
        assert not log.display or not any(t.region.overlaps(log.region) for t in toasts), \
            ([t.region for t in toasts], log.region)


async def test_r_and_k_on_a_done_shard_are_refused_by_the_same_rule_as_fleet_restart():
    """The one rule (fleet/actions.py) behind every caller: `r` on a DONE shard asks nothing and says
    why, as `fleet restart` does; with a DONE and a running shard marked, only the running one is
    asked about."""
    f = fleet(failed=(), backoff=())
    f.finish([1])
    app = FleetApp(f, interval=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(pilot, app)
        table = app.main.query_one(ShardTable)
        table.move_to_key("1")
        await until(pilot, lambda: table.selected_shard == 1, what="shard 1 selected")
        await pilot.press("r")
        told = lambda: [n.message for n in app._notifications]
        await until(pilot, lambda: any("shard 1 is DONE: nothing to redo" in m for m in told()), what="r refused")
        assert app.screen is app.main                                   # no question asked
        await pilot.press("x")
        await until(pilot, lambda: any("shard 1 is DONE: nothing to stop" in m for m in told()), what="x refused")
        assert app.screen is app.main
        table.move_to_key("0")
        await pilot.press("space")                                      # marks 0
        table.move_to_key("1")
        await pilot.press("space", "r")                                 # marks 1, restart both
        assert "Restart shard(s) 0?" in question(app)
        await pilot.press("n")


async def test_reattach_first_frame_says_reading_not_pending():
    """Issue 25: re-attach's first frame said "PENDING 2" before the hosts' records were read.
    Until they are, the top bar says it is reading them and counts no state, rate or ETA."""
    f = fleet()
    for host in f.hosts.values():
        host.replayed = False
    app = FleetApp(f, interval=3600)
    async with app.run_test(size=(120, 40)) as pilot:
        await drawn(pilot, app)
        top = str(app.main.query_one("#top").render())
        assert "reading hosts…" in top and "PENDING" not in top and "RUNNING" not in top, top
        assert "samples/s" not in top and "ETA ?" not in top and "ETA ~" not in top, top
        table = app.main.query_one(ShardTable)
        assert all(cell(table, k, "state") == "… replaying" for k in table.keys)
        shown = str(app.main.query_one(ShardDetail).render())            # the detail line says it too
        assert "replaying" in shown and "PENDING" not in shown and "0/0" not in shown, shown
        for host in f.hosts.values():
            host.replayed = True
        await redrawn(pilot, app)
        top = str(app.main.query_one("#top").render())
        assert "reading hosts" not in top and "RUNNING" in top, top
        shown = str(app.main.query_one(ShardDetail).render())
        assert "replaying" not in shown and "samples" in shown, shown


@contextlib.asynccontextmanager
async def laid_out(hosts: int, gpus: int, size: tuple[int, int]):
    """The live view of a synthetic fleet at `size`, settled: (main screen, shard table, log),
    with nothing off screen."""
    f = SyntheticFleet(hosts=hosts, gpus=gpus, seed=1)
    f.tick(1.0)
    app = FleetApp(f, interval=3600)
    async with app.run_test(size=size) as pilot:
        await drawn(pilot, app)
        await pilot.pause()                                     # laid out for the first snapshot's rows
        main = app.main
        assert main.virtual_size.height == size[1]                            # nothing off screen
        yield main, main.query_one(ShardTable), main.query_one("#log", LogView)


@pytest.mark.parametrize("size", [(120, 40), (160, 50), (200, 60)])
async def test_no_blank_rows_under_a_short_shard_table(size):
    """Issue 25: 15 blank rows at 120x40 under a 2-shard table. The shards take the rows they need
    and the log the rest; a long table takes what the chart and the log's minimum leave."""
    for hosts, gpus in ((1, 2), (8, 8)):
        async with laid_out(hosts, gpus, size) as (main, table, log):
            if hosts == 1:
                assert table.region.height == table.row_count + 1, (size, table.region)
                assert log.region.height > (10 if size[1] >= 50 else 6)        # the rows went to the log
            else:
                assert table.region.height < table.row_count + 1                # scrolls
                assert log.region.height == (10 if size[1] >= 50 else 6)       # the log at its minimum
            assert main.query_one("#detail").region.bottom <= main.query_one("#throughput").region.y


@pytest.mark.parametrize("size", [(80, 24), (100, 29)])
async def test_under_30_rows_the_log_takes_the_rows_a_short_table_leaves(size):
    """Issue 39: 11 blank rows at 80x24 under a 4-row shard table. Below 30 rows there is no chart;
    the shards take the rows they need and the log what they leave, shown only where that is at
    least 3 lines (a long table keeps every row, as before)."""
    for hosts, gpus in ((1, 4), (3, 4)):
        async with laid_out(hosts, gpus, size) as (main, table, log):
            assert not main.query_one("#throughput").display
            if hosts == 1:
                assert table.region.height == table.row_count + 1, (size, table.region)
                assert log.display and log.region.height >= 3                  # the rows went to the log
                assert main.query_one("#detail").region.bottom <= main.query_one("#log-title").region.y
            else:
                assert not log.display and table.region.height >= 6            # the shards keep them


@pytest.mark.parametrize("seconds", [39, 630])
async def test_the_chart_axis_fits_the_run(seconds):
    """Issue 25: a 39-second run showed a 30-minute axis (the past was rebuilt as a fixed number
    of 10 s intervals). Re-attached to a run `seconds` old, the axis spans the run, at most a
    third longer."""
    from fleet.tui.panes.throughput import MARGIN, ThroughputChart, bucket_for
    f = SyntheticFleet(hosts=1, gpus=2, seed=1, loop=True)   # recorded runs, replayed again as they end
    for _ in range(seconds - 1):
        f.tick(1.0)
    for _, _, r in f.shards:                    # the run was launched `seconds` before the view opens
        r.first_launch_t = f.now - seconds
    app = FleetApp(f, interval=3600)
    async with app.run_test(size=(180, 50)) as pilot:
        await drawn(pilot, app)
        chart = app.main.query_one(ThroughputChart)
        elapsed = app.snap.totals.elapsed_s
        assert abs(elapsed - seconds) <= 2
        plot = chart.size.width - MARGIN - 1
        axis = bucket_for(chart.points, chart.now, plot, chart.start) * plot
        assert elapsed <= axis <= elapsed * 4 / 3 + 1, (elapsed, axis)
        labels = chart._draw(chart.size.width, chart.size.height)[-1].text.split()
        oldest = labels[0]
        ago = int(oldest[1:-1]) * (60 if oldest.endswith("m") else 1)
        assert ago <= axis, (labels, axis)


async def test_focus_returns_to_the_pane_that_had_it_after_the_palette_or_a_modal(ui):
    """Issue 39: after ctrl+p then esc, Down and space did nothing until a click. The pane that had
    the focus has it again when the command palette, the help or a question closes."""
    f, app, pilot, table = ui
    assert table.has_focus
    await pilot.press("down")
    for keys in (("ctrl+p",), ("question_mark",), ("r",)):
        await pilot.press(*keys)
        await until(pilot, lambda: app.screen is not app.main, what=f"what {keys} opens")
        await pilot.press("escape")
        await until(pilot, lambda: app.screen is app.main, what=f"what {keys} opened, closed")
        await pilot.pause()
        assert table.has_focus, keys
    before = table.selected_shard
    await pilot.press("down")
    assert table.selected_shard == before + 1
    log = app.main.query_one("#log", LogView)
    await pilot.press("tab")
    assert log.has_focus
    await pilot.press("ctrl+p")
    await until(pilot, lambda: isinstance(app.screen, CommandPalette), what="the palette")
    await pilot.press("escape")
    await until(pilot, lambda: app.screen is app.main, what="the palette closed")
    await pilot.pause()
    assert log.has_focus                                         # the other pane, as it was


def screen_text(app) -> list[str]:
    """The screen as a terminal shows it: one string per row, from the compositor's own strips."""
    return ["".join(seg.text for seg in strip) for strip in app.screen._compositor.render_strips()]


@pytest.mark.parametrize("width", [60, 80, 120, 200])
async def test_every_width_keeps_the_state_its_reason_the_countdown_and_the_alert(width):
    """Issue 55: at 80 columns the BACKOFF reason was cut, at 60 the top bar dropped "% of
    expected". From 60 columns on, a BACKOFF shard's row keeps its state, its countdown and its
    reason's first words, and the top bar the run's share of the expected rate."""
    app = FleetApp(fleet(), interval=3600)
    async with app.run_test(size=(width, 24)) as pilot:
        await drawn(pilot, app)
        # (a loaded machine may draw the top bar before the shards' rows: their screen is waited for)
        shard5 = lambda: [r for r in screen_text(app)[3:] if re.search(r"\b5 .*↻ BACKOFF", r)]  # noqa: E731
        await until(pilot, shard5, what="shard 5's row")
        rows = screen_text(app)
        assert all(len(r) <= width for r in rows)
        assert "% of expected" in rows[1], rows[:3]
        backoff = shard5()[0]
        assert re.search(r"↻ BACKOFF \d+s", backoff) and "killed by" in backoff, backoff


@pytest.mark.parametrize("width", [80, 200])
async def test_an_unreachable_hosts_row_gives_its_reason_the_rest_of_the_row(width):
    """Issue 55: the unreachable host's reason sat in one 10-cell column, cut even at 200 columns."""
    f = fleet(unreachable=(1,))
    app = FleetApp(f, interval=3600)
    async with app.run_test(size=(width, 40)) as pilot:
        await drawn(pilot, app)
        error = next(h.error for h in app.snap.hosts if h.reachable is False)
        row = next(r for r in screen_text(app) if "UNKNOWN: unreachable" in r)
        assert error in row and "· last seen 5s ago" in row, (error, row)

