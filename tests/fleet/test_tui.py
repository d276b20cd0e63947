"""The live TUI: Textual's pilot on a real local fleet (real workers), visual snapshots of the main
screen and the log view, and a smoke test in a real terminal (tmux)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from bench.synthetic_fleet import SyntheticFleet
from fleet.config import load_config
from fleet.state import State
from fleet.supervisor import Supervisor
from fleet.tui.app import QUIT_MESSAGE, FleetApp
from fleet.tui.panes.gpus import GpuTable
from fleet.tui.panes.log import ShardLog
from fleet.tui.panes.shards import ShardTable
from fleet.tui.panes.topbar import TopBar
from fleet.tui.source import SupervisorSource
from tests.conftest import REPO


def local_toml(tmp_path, model: str, data: str, max_restarts: int = 0) -> str:
    text = f"""
[run]
name = "tui"
model = {json.dumps(model)}
data = {json.dumps(data)}
output = "out"
max_tokens_per_batch = 256
device = "cpu"
env = {{ OMP_NUM_THREADS = "1" }}

[expected]
samples_per_s_per_gpu = 50

[supervise]
max_restarts = {max_restarts}

[[hosts]]
name = "local"
address = "local"
gpus = [0, 1]
root = "fleet"
"""
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture
def long_data(tmp_path):
    from worker.demo import make_token_dataset
    return make_token_dataset(str(tmp_path / "data.jsonl"), 16000, vocab_size=500, mean_tokens=60, seed=2)


def pid_of(tmp_path, shard: int) -> int:
    return int(open(tmp_path / "fleet" / "tui" / "shards" / str(shard) / "pid").read())


def cell_text(table, row: str, column: str) -> str:
    value = table.get_cell(row, column)
    return value.plain if hasattr(value, "plain") else str(value)


async def until(pilot, predicate, timeout: float = 120, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await pilot.pause(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def supervised_app(sup: Supervisor) -> FleetApp:
    """The TUI on a deployed supervisor, which it starts and launches (as `fleet up` does)."""
    async def open_source():
        await sup.start()
        source = SupervisorSource(sup)
        source.launch_task = asyncio.create_task(sup.launch_all())
        return source
    return FleetApp(open_source=open_source, interval=0.2)


async def test_live_tui_kill_restart_filter_and_quit(tmp_path, dense_model, long_data):
    config = load_config(local_toml(tmp_path, dense_model, long_data))
    sup = Supervisor(config)
    results, failures = await sup.deploy()
    assert not failures and not results[0].errors
    await sup.settle_plan(results)
    app = supervised_app(sup)
    try:
        async with app.run_test(size=(170, 48)) as pilot:
            shards = app.query_one(ShardTable)
            await until(pilot, lambda: app.snap and all(s.state == State.RUNNING for s in app.snap.shards),
                        what="both shards running")
            await until(pilot, lambda: app.snap.totals.samples_per_s is not None, what="a rate")
            # Every pane renders.
            assert "fleet tui" in str(app.query_one(TopBar).render())
            gpus = app.query_one(GpuTable)
            assert gpus.row_count >= 1
            if not app.snap.hosts[0].gpus:
                assert cell_text(gpus, "local/x", "mem") == "no GPU telemetry"
            assert shards.row_count == 2
            assert "throughput" in str(app.query_one("#tp-label").render())
            await until(pilot, lambda: len(app.query_one(ShardLog).lines) > 2, what="log lines")

            os.kill(pid_of(tmp_path, 0), signal.SIGKILL)
            await until(pilot, lambda: cell_text(shards, "0", "state") == "FATAL", what="shard 0 FATAL")
            assert "killed by signal 9" in cell_text(shards, "0", "reason")

            await pilot.press("f")                                   # faulty only
            await until(pilot, lambda: shards.row_count == 1, what="faulty filter")
            assert cell_text(shards, "0", "id") == "0"
            await pilot.press("f")
            await pilot.press("slash", *"local:1", "enter")          # text filter
            await until(pilot, lambda: shards.row_count == 1 and shards.selected_shard == 1, what="text filter")
            await pilot.press("escape")
            await until(pilot, lambda: shards.row_count == 2, what="filter cleared")

            shards.move_cursor(row=0)
            await pilot.press("r")
            await pilot.pause(0.3)
            assert "Restart shard(s) 0?" in str(app.screen.query_one("#question").render())
            await pilot.press("y")
            await until(pilot, lambda: cell_text(shards, "0", "state") in ("STARTING", "LOADING", "RUNNING"),
                        what="shard 0 restarted")
            await until(pilot, lambda: cell_text(shards, "0", "state") == "RUNNING", what="shard 0 running")
            live_pid = pid_of(tmp_path, 0)
            await pilot.press("q")
        assert app.return_value == QUIT_MESSAGE
        os.kill(live_pid, 0)                                         # q left the worker running
        # It goes on to DONE unsupervised, resuming where the killed one stopped.
        check = Supervisor(config)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            snap = await check.read_once()
            if [s.state for s in snap.shards] == [State.DONE, State.DONE]:
                break
            await asyncio.sleep(1)
        await check.close()
        assert [s.state for s in snap.shards] == [State.DONE, State.DONE]
        assert snap.shards[0].restarts == 1 and snap.totals.done == 16000
    finally:
        await Supervisor(config).stop_all()


def synthetic_app() -> FleetApp:
    fleet = SyntheticFleet(hosts=3, gpus=4, seed=7, unreachable=(2,), failed=(1,), log_lines=12)
    for _ in range(20):
        fleet.tick(1.0)
    return FleetApp(fleet, interval=3600)


def test_snapshot_main_screen(snap_compare):
    assert snap_compare(synthetic_app(), terminal_size=(170, 48), run_before=_settle)


def test_snapshot_log_view(snap_compare):
    async def open_log(pilot):
        await _settle(pilot)
        await pilot.press("down", "l")
        await pilot.pause(0.5)
    assert snap_compare(synthetic_app(), terminal_size=(120, 30), run_before=open_log)


async def _settle(pilot):
    await pilot.pause(0.5)


async def test_keys_on_a_synthetic_fleet_mark_stop_sort_and_help():
    fleet = SyntheticFleet(hosts=2, gpus=4, seed=1, failed=(3, 5))
    app = FleetApp(fleet, interval=0.1)
    async with app.run_test(size=(170, 48)) as pilot:
        await pilot.pause(0.3)
        table = app.query_one(ShardTable)
        await pilot.press("space", "space")                          # mark shards 0 and 1
        assert table.marked == {0, 1}
        await pilot.press("k", "y")
        await pilot.pause(0.3)
        assert [(s.state, s.reason) for s in app.snap.shards[:2]] == [(State.STOPPED, "stopped")] * 2
        assert table.marked == set()
        await pilot.press("R")                                       # stopped shards are not failures
        await pilot.pause(0.2)
        assert "Restart 2 FAILED/BACKOFF/FATAL shard(s): 3, 5?" in str(app.screen.query_one("#question").render())
        await pilot.press("n")
        await pilot.press("s")                                       # sort by state: failures first
        await pilot.pause(0.3)
        assert table.selected_key is not None and app.sort == "state"
        assert cell_text(table, table._order[0], "state") == "FATAL"
        await pilot.press("question_mark")
        await pilot.pause(0.2)
        assert "restart every FAILED / BACKOFF / FATAL shard" in str(app.screen.query_one("Static").render())


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is installed by scripts/test.sh")
def test_tmux_smoke_real_terminal(tmp_path, dense_model, long_data):
    config = local_toml(tmp_path, dense_model, long_data)
    session = f"fleet-smoke-{os.getpid()}"
    env_cmd = f"sleep 1; cd {REPO} && {sys.executable} -m fleet.cli up -c {config}; sleep 60"
    # The size is set before the window exists: any later resize races the app's start-up.
    subprocess.run(["tmux", "start-server", ";", "set-option", "-g", "default-size", "170x48"], check=True)
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "170", "-y", "48", env_cmd], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    def wait_screen(pred, what, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = screen()
            if pred(text):
                return text
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{screen()}")
    size = subprocess.run(["tmux", "display", "-p", "-t", session, "#{window_width}x#{window_height}"],
                          capture_output=True, text=True).stdout.strip()
    try:
        assert size == "170x48", size
        wait_screen(lambda t: t.count("RUNNING") >= 2 and "local:1" in t, "two running shards")
        os.kill(pid_of(tmp_path, 0), signal.SIGKILL)
        wait_screen(lambda t: "FATAL" in t, "FATAL on screen")
        subprocess.run(["tmux", "send-keys", "-t", session, "r"], check=True)
        wait_screen(lambda t: "Restart shard(s) 0?" in t, "confirmation")
        subprocess.run(["tmux", "send-keys", "-t", session, "y"], check=True)
        wait_screen(lambda t: "FATAL" not in t and t.count("RUNNING") >= 2, "shard 0 running again")
        subprocess.run(["tmux", "send-keys", "-t", session, "q"], check=True)
        wait_screen(lambda t: "the workers keep running" in t, "quit message")
        events = [json.loads(l) for l in open(tmp_path / "fleet" / "tui" / "shards" / "0" / "events.jsonl")]
        assert [e["by"] for e in events if e["event"] == "launch"] == ["manual", "manual"]
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
        subprocess.run([sys.executable, "-m", "fleet.cli", "down", "--yes", "-c", config], cwd=REPO,
                       capture_output=True)
