"""The live TUI through its real producer: Textual's pilot on a real local fleet (the real
supervisor, real worker processes on the tiny model), then a re-attach to the same run; and `fleet
up` itself in a real terminal (tmux) at 80x24. Layout, keys and visuals on the synthetic fleet are
in test_tui_keys.py and test_tui_snapshots.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from fleet.config import load_config
from fleet.state import State
from fleet.supervisor import Supervisor
from tests.fleet.tui_wait import until
from fleet.tui.app import QUIT_MESSAGE, FleetApp
from fleet.tui.panes.gpus import GpuPane
from fleet.tui.panes.lines import cell_text
from fleet.tui.panes.log import LogView
from fleet.tui.panes.shards import COLUMN_KEYS, ShardTable
from fleet.tui.panes.throughput import ThroughputChart
from fleet.tui.panes.topbar import TopBar
from fleet.source import SupervisorSource
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
usd_per_hour = 3.6
"""
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return str(path)


@pytest.fixture
def long_data(tmp_path):
    from worker.demo import make_token_dataset
    return make_token_dataset(str(tmp_path / "data.jsonl"), 10000, vocab_size=500, mean_tokens=60, seed=2)


def pid_of(tmp_path, shard: int) -> int:
    return int(open(tmp_path / "fleet" / "tui" / "shards" / str(shard) / "pid").read())


def cell(table, row: str, column: str) -> str:
    return cell_text(table.cells_of(row)[COLUMN_KEYS.index(column)])


async def confirm(pilot, app, keys: list[str], question: str) -> None:
    """Press `keys`, check the confirmation asks `question`, answer yes."""
    await pilot.press(*keys)
    await until(pilot, lambda: app.screen.query("#question"), what=f"the question after {keys}")
    assert question in str(app.screen.query_one("#question").render())
    await pilot.press("y")


class Watched(FleetApp):
    """FleetApp that keeps what it showed: the state cells of every draw, toasts and bells."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.frames: list[tuple[bool, dict[str, str]]] = []
        self.toasts: list[str] = []
        self.bells = 0

    def draw(self, snap) -> None:
        super().draw(snap)
        if not self.main.query(ShardTable):
            return                                  # the screen is not composed yet
        table = self.main.query_one(ShardTable)
        self.frames.append((snap.totals.replayed, {k: cell(table, k, "state") for k in table.keys}))

    def notify(self, message, *a, **kw):
        self.toasts.append(str(message))
        return super().notify(message, *a, **kw)

    def bell(self) -> None:
        self.bells += 1


def opener(sup: Supervisor):
    async def open_source():
        await sup.start()
        source = SupervisorSource(sup)
        source.launch_task = asyncio.create_task(sup.launch_all())
        return source
    return open_source


def supervised_app(sup: Supervisor) -> FleetApp:
    """The TUI on a deployed supervisor, which it starts and launches (as `fleet up` does)."""
    return FleetApp(open_source=opener(sup), interval=0.2)


async def test_live_tui_kill_stop_restart_filter_then_reattach_to_the_finish(tmp_path, dense_model, long_data):
    config = load_config(local_toml(tmp_path, dense_model, long_data))
    sup = Supervisor(config)
    await sup.prepare(say=lambda line: None, step=lambda line: None)

    app = Watched(open_source=opener(sup), interval=0.2)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            shards = app.main.query_one(ShardTable)
            await until(pilot, lambda: app.snap and all(s.state == State.RUNNING for s in app.snap.shards),
                        what="both shards running")
            # Honest numbers: the workers sent their shards' tokens, so ETA and ratio are in tokens.
            await until(pilot, lambda: app.snap.totals.eta_unit == "tokens" and
                        all(s.eta_s is not None for s in app.snap.shards), what="ETAs in tokens")
            t = app.snap.totals
            assert t.ratio_unit == "tokens" and t.total_tokens == sum(s.total_tokens for s in app.snap.shards)
            assert t.gpus_planned == 2 and t.usd_per_hour == 3.6 and t.usd_spent is not None
            top = str(app.main.query_one(TopBar).render())
            assert "fleet tui" in top and "tok/s" in top and "ETA" in top and "(tokens)" in top
            assert cell(shards, "0", "eta") != "?"
            # A CPU run has no GPU telemetry: the GPU pane is one line that says so.
            gpus = app.main.query_one(GpuPane)
            assert gpus.has_class("-oneline") and gpus.outer_size.height == 1
            assert "no GPU telemetry" in str(app.main.query_one("#gpus-title").render())
            # ... and what bounds the host, once its workers have counted seconds of batches.
            await until(pilot, lambda: app.snap.hosts[0].bound is not None, what="the host's bound")
            await until(pilot, lambda: "bound by " in str(app.main.query_one("#gpus-title").render()),
                        what="the bound in the GPU pane")
            assert re.search(r"local: no GPU telemetry, bound by (GPU|disk): GPUs waited \d+%",
                             str(app.main.query_one("#gpus-title").render()))
            await until(pilot, lambda: len(app.main.query_one("#log", LogView).lines) > 2, what="log lines")

            # SIGKILL: FATAL (max_restarts 0), told by a toast and the bell while watching.
            os.kill(pid_of(tmp_path, 0), signal.SIGKILL)
            await until(pilot, lambda: cell(shards, "0", "state") == "✖ FATAL", what="shard 0 FATAL")
            assert "killed by signal 9" in cell(shards, "0", "reason")
            await until(pilot, lambda: app.bells >= 1, what="the bell")
            assert any("shard 0" in m and "-> FATAL" in m for m in app.toasts), app.toasts
            assert not any("shard 1" in m for m in app.toasts), app.toasts   # no false alarm at launch

            await pilot.press("f")                                   # faulty only
            await until(pilot, lambda: shards.row_count == 1, what="faulty filter")
            await pilot.press("f")
            await pilot.press("slash", *"local:1")                   # filters as it is typed
            await until(pilot, lambda: shards.row_count == 1 and shards.selected_shard == 1, what="live filter")
            await pilot.press("escape")
            await until(pilot, lambda: shards.row_count == 2, what="filter cleared")

            # x on shard 1: STOPPED, never FAILED or BACKOFF on the way, and not restarted.
            shards.move_to_key("1")
            await confirm(pilot, app, ["x"], "Stop shard(s) 1?")
            await until(pilot, lambda: cell(shards, "1", "state") == "■ STOPPED", what="shard 1 STOPPED")
            drawn_by_now = len(app.frames)                              # five more frames: not restarted
            await until(pilot, lambda: len(app.frames) >= drawn_by_now + 5, what="five frames after the stop")
            seen1 = [f[1].get("1") for f in app.frames if f[0]]
            assert not {"✗ FAILED", "↻ BACKOFF", "✖ FATAL"} & set(seen1), seen1
            assert cell(shards, "1", "state") == "■ STOPPED" and cell(shards, "1", "reason") == "stopped"
            # The worker took the SIGTERM it was sent as the stop it was: no failure recorded.
            from worker import protocol
            shard1 = protocol.read_events(str(tmp_path / "fleet" / "tui" / "shards" / "1" / "events.jsonl"))
            assert [type(e).__name__ for e in shard1 if isinstance(e, (protocol.Failed, protocol.StopRequested))] \
                == ["StopRequested"]

            shards.move_to_key("0")
            await confirm(pilot, app, ["r"], "Restart shard(s) 0?")
            await until(pilot, lambda: cell(shards, "0", "state") == "▶ RUNNING", what="shard 0 running again")
            assert cell(shards, "0", "reason") == "" and cell(shards, "0", "restarts") == "0/0"
            # measured again (two progress points in the new attempt): the chart's past has data
            await until(pilot, lambda: app.snap.shards[0].tokens_per_s, what="shard 0 measured again")
            await pilot.press("q")
        assert app.return_value == QUIT_MESSAGE                      # shard 0 still runs
        os.kill(pid_of(tmp_path, 0), 0)

        # Re-attach: the first frames say "replaying", never PENDING 0/0; the chart's past is
        # rebuilt from the records; `:restart 1` brings the stopped shard back; the end is told.
        attach = Supervisor(config)
        attach.store.use_plan(sup.plan)                                    # as `fleet up` does after deploy
        again = Watched(open_source=opener(attach), interval=0.2)
        async with again.run_test(size=(120, 40)) as pilot:
            await until(pilot, lambda: again.snap is not None and again.snap.totals.replayed, what="replayed")
            assert again.frames and all(len(cells) == 2 for _, cells in again.frames)
            assert all(cells[k] != "○ PENDING" for replayed, cells in again.frames for k in cells), \
                again.frames[:3]
            chart = again.main.query_one(ThroughputChart)
            assert chart.rebuilt and any(v > 0 for _, v in chart.points)
            await confirm(pilot, again, ["colon", *"restart 1", "enter"], "Restart shard(s) 1?")
            await until(pilot, lambda: again.snap.totals.finished, timeout=300, what="both DONE")
            await until(pilot, lambda: "→ fleet verify" in str(again.main.query_one(TopBar).render()),
                        what="the finished banner")
            await until(pilot, lambda: any("2/2 shards DONE" in m for m in again.toasts),   # its own message,
                        what="the finished toast")                                          # a tick apart
            top = str(again.main.query_one(TopBar).render())
            assert "✓ 2/2 shards DONE in" in top and "→ fleet verify" in top
            keys = {b.binding.key for b in again.screen.active_bindings.values() if b.enabled}
            assert not {"r", "R", "x", "D"} & keys                  # nothing left to restart or stop
            assert any("2/2 shards DONE" in m and "fleet verify" in m for m in again.toasts), again.toasts
            final = again.snap
            await pilot.press("q")
        assert again.return_value.startswith("fleet: run tui is finished: 2/2 shards DONE in")
        assert final.totals.elapsed_s == again.source.snapshot().totals.elapsed_s     # frozen
        snap = await Supervisor(config).read_once()
        assert [s.state for s in snap.shards] == [State.DONE, State.DONE]
        assert snap.shards[0].restarts == 1 and snap.totals.done == 10000
    finally:
        await Supervisor(config).stop_all()


class Tmux:
    """A tmux server of the test's own (its own socket, `-L`): a test on another xdist worker
    that ends its session stops only its own server. On the one shared server, that exit raced
    this test's `new-session`, which then failed."""

    def __init__(self, name: str):
        self.socket, self.session = f"{name}-{os.getpid()}", name

    def __call__(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", self.socket, *args], **kw)

    def start(self, cmd: str, cols: int, rows: int) -> None:
        """The session, with the size set before its window exists (any later resize races the
        app's start-up); one tmux command, so the new server holds a session before it can exit."""
        self("start-server", ";", "set-option", "-g", "default-size", f"{cols}x{rows}", ";",
             "new-session", "-d", "-s", self.session, "-x", str(cols), "-y", str(rows), cmd, check=True)

    def screen(self, escapes: bool = False) -> str:
        return self("capture-pane", *(["-e"] if escapes else []), "-p", "-t", self.session,
                    capture_output=True, text=True).stdout

    def stop(self) -> None:
        self("kill-server", capture_output=True)

    def wait(self, pred, what: str, timeout: float = 180) -> str:
        """The screen once `pred(screen)` holds; fails naming `what` (and showing the screen) after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen()
            if pred(text):
                return text
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{self.screen()}")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is installed by scripts/test.sh")
def test_tmux_smoke_real_terminal_at_80x24(tmp_path, dense_model, long_data):
    config = local_toml(tmp_path, dense_model, long_data)
    tmux = Tmux("fleet-smoke")
    tmux.start(f"sleep 1; cd {REPO} && {sys.executable} -m fleet.cli up -c {config}; echo QUIT-ONE; "
               f"{sys.executable} -m fleet.cli up -c {config}; sleep 60", 80, 24)

    wait_screen = tmux.wait
    size = tmux("display", "-p", "-t", tmux.session, "#{window_width}x#{window_height}",
                capture_output=True, text=True).stdout.strip()
    try:
        assert size == "80x24", size
        # Deploy steps are printed as they happen, before the live view opens.
        wait_screen(lambda t: "local: preflight" in t or "RUNNING" in t, "deploy steps or the view")
        text = wait_screen(lambda t: t.count("▶ RUNNING") >= 2 and "local:1" in t, "two running shards")
        assert "tok/s" in text and "ETA" in text and "no GPU telemetry" in text
        os.kill(pid_of(tmp_path, 0), signal.SIGKILL)
        text = wait_screen(lambda t: "✖ FATAL" in t and "killed by signal 9" in t, "FATAL and its reason")
        tmux("send-keys", "-t", tmux.session, "r", check=True)
        wait_screen(lambda t: "Restart shard(s) 0?" in t, "confirmation")
        tmux("send-keys", "-t", tmux.session, "y", check=True)
        wait_screen(lambda t: "✖ FATAL" not in t and t.count("▶ RUNNING") >= 2, "shard 0 running again")
        tmux("send-keys", "-t", tmux.session, "C-c", check=True)     # quits like q
        # The view was a client: its supervisor goes on, and a `fleet up` joins it at once, with
        # no deploy and no preflight, and finds shard 0 as the restart left it.
        wait_screen(lambda t: "QUIT-ONE" in t, "the first view closed")
        wait_screen(lambda t: t.count("▶ RUNNING") >= 2 and "local:1" in t and "QUIT-ONE" not in t, "the view again")
        tmux("send-keys", "-t", tmux.session, "q", check=True)
        wait_screen(lambda t: t.count("its supervisor: pid") == 2, "the second quit message")
        said = tmux("capture-pane", "-p", "-S", "-400", "-t", tmux.session, capture_output=True,
                    text=True).stdout.split("QUIT-ONE")[1]
        assert "joining the run's supervisor (pid" in said and "deploying" not in said and "preflight" not in said, said
        events = [json.loads(l) for l in open(tmp_path / "fleet" / "tui" / "shards" / "0" / "events.jsonl")]
        assert [e["by"] for e in events if e["event"] == "launch"] == ["manual", "manual"]
    finally:
        tmux.stop()
        subprocess.run([sys.executable, "-m", "fleet.cli", "down", "--yes", "-c", config], cwd=REPO,
                       capture_output=True)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is installed by scripts/test.sh")
def test_keys_in_a_burst_enter_on_a_stop_and_a_hung_worker_at_80x24(tmp_path):
    """Issue 55, in a real terminal: `/local:1` typed in one burst is a filter (not `l`, the log
    view); `x` then Enter stops nothing (the dialog opens on Cancel); a worker frozen with SIGSTOP
    reads `◷ LATE` in its row and in the top bar's counts at 80 columns, long before its
    stall_timeout, and RUNNING again once it goes on."""
    from tests.fleet.test_records import job_toml
    ticks = [[["ticks", 100000, 0.5]]]
    config = job_toml(tmp_path, {"0": ticks, "1": ticks}, gpus=(0, 1), stall="120s")
    tmux = Tmux("fleet-keys")
    tmux.start(f"cd {REPO} && {sys.executable} -m fleet up -c {config}; sleep 60", 80, 24)

    def wait_screen(pred, what, timeout=120):
        return tmux.wait(pred, what, timeout)
    keys = lambda *k: tmux("send-keys", "-t", tmux.session, *k, check=True)    # noqa: E731
    try:
        wait_screen(lambda t: t.count("▶ RUNNING") >= 2 and "local:1" in t, "two running shards")
        keys("/local:1")                                               # one send-keys: one burst
        text = wait_screen(lambda t: "shards (1/2)" in t, "the filter typed in one burst")
        assert "— log ·" not in text and "local:1" in text.splitlines()[-3], text    # no log view: the filter
        keys("Escape")
        wait_screen(lambda t: "shards (2/2)" in t, "the filter cleared")
        keys("x")
        wait_screen(lambda t: "Stop shard(s) " in t and "Cancel" in t, "the stop dialog")
        keys("Enter")
        wait_screen(lambda t: "Stop shard(s)" not in t, "the dialog cancelled")
        group = os.getpgid(pid_of_run(tmp_path, "job", 1))
        os.killpg(group, signal.SIGSTOP)
        try:
            text = wait_screen(lambda t: t.count("◷ LATE") >= 2, "LATE in the row and the top bar", timeout=60)
            assert "STOPPED" not in text and "STALLED" not in text, text
        finally:
            os.killpg(group, signal.SIGCONT)
        wait_screen(lambda t: "LATE" not in t and t.count("▶ RUNNING") >= 2, "RUNNING again")
        for line in open(tmp_path / "fleet" / "job" / "shards" / "0" / "events.jsonl"):
            assert '"event": "stop' not in line, line                  # nothing was stopped
    finally:
        tmux.stop()
        subprocess.run([sys.executable, "-m", "fleet.cli", "down", "--yes", "-c", config], cwd=REPO,
                       capture_output=True)


def pid_of_run(tmp_path, run: str, shard: int) -> int:
    return int(open(tmp_path / "fleet" / run / "shards" / str(shard) / "pid").read())


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is installed by scripts/test.sh")
def test_no_color_sends_no_colour_to_a_real_terminal():
    """NO_COLOR=1: the live view (on the synthetic fleet) writes no colour escape at all — not even
    256-colour greys — and every state still reads by its glyph."""
    tmux = Tmux("fleet-nocolor")
    tmux.start(f"cd {REPO} && NO_COLOR=1 {sys.executable} bench/tui.py --show --hosts 3 --gpus 4; sleep 30", 120, 30)
    try:
        deadline, text = time.monotonic() + 60, ""
        while time.monotonic() < deadline and "▶ RUNNING" not in text:
            time.sleep(0.3)
            text = tmux.screen(escapes=True)
        assert "▶ RUNNING" in text, text
        colours = [m for m in ("[38;5;", "[48;5;", "[38;2;", "[48;2;", "[31m", "[32m", "[41m") if m in text]
        assert not colours, (colours, text[:400])
    finally:
        tmux.stop()
