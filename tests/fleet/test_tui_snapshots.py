"""What the live view looks like (pytest-textual-snapshot): the synthetic fleet with failures of
every kind present (FATAL, BACKOFF counting down, STALLED, STOPPED, an unreachable host), at
80x24, 120x40 and 220x60; under NO_COLOR; a finished run; the log view and the help screen. Each
compares to an SVG in __snapshots__/ (update with --snapshot-update after looking at the change)."""

from __future__ import annotations

import pytest

from bench.synthetic_fleet import SyntheticFleet
from fleet.tui.app import FleetApp
from fleet.tui.panes.log import LogView
from fleet.tui.screens import HelpScreen, LogScreen
from tests.fleet.tui_wait import drawn, until


def troubled(hosts: int = 3, gpus: int = 4) -> FleetApp:
    fleet = SyntheticFleet(hosts=hosts, gpus=gpus, seed=7, unreachable=(hosts - 1,), failed=(1,),
                           backoff=(4,), stalled=(6,), stopped=(2,), log_lines=12)
    for _ in range(30):
        fleet.tick(1.0)
    return FleetApp(fleet, interval=3600)


async def settle(pilot):
    await drawn(pilot, pilot.app)
    await pilot.pause()


@pytest.mark.parametrize("size", [(60, 24), (80, 24), (100, 30), (120, 40), (200, 60), (220, 60)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_snapshot_main_screen_with_failures(snap_compare, size):
    app = troubled() if size[0] < 200 else troubled(hosts=8, gpus=8)
    assert snap_compare(app, terminal_size=size, run_before=settle)


def test_snapshot_no_color_marks_states_by_glyph_and_weight(snap_compare, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    app = troubled()
    assert app.no_color
    assert snap_compare(app, terminal_size=(120, 40), run_before=settle)


def test_snapshot_a_finished_run_says_so(snap_compare):
    fleet = SyntheticFleet(hosts=2, gpus=4, seed=3)
    while not fleet.snapshot().totals.finished:                  # each shard ends when its work does
        fleet.tick(5.0)
    for _ in range(12):
        fleet.tick(5.0)
    assert snap_compare(FleetApp(fleet, interval=3600), terminal_size=(120, 40), run_before=settle)


def test_snapshot_log_view(snap_compare):
    async def open_log(pilot):
        await settle(pilot)
        await pilot.press("down", "l")
        await until(pilot, lambda: isinstance(pilot.app.screen, LogScreen) and pilot.app.screen.query_one(LogView).lines,
                    what="the log read")
        await pilot.pause()
    assert snap_compare(troubled(), terminal_size=(120, 30), run_before=open_log)


def test_snapshot_help_at_80x24(snap_compare):
    async def open_help(pilot):
        await settle(pilot)
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(pilot.app.screen, HelpScreen), what="the help")
        await pilot.pause()
    assert snap_compare(troubled(), terminal_size=(80, 24), run_before=open_help)
