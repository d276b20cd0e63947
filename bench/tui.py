"""The TUI at fleet scale: 64 hosts x 8 GPUs = 512 shards, snapshots fed at the telemetry rate.

Three figures, in one headless Textual app (the same FleetApp `fleet up` opens):
  cpu    : CPU seconds used by the process (snapshot maths + drawing) per second of wall time,
           while the synthetic fleet ticks every 0.25 s (each shard replaying a recorded run of the
           real worker, a progress event every 2 s, started again when it ends) and the screen
           redraws at its default 1.5 s;
  latency: keypress to screen, two ways, over the same 40 keys (sort by the next column,
           faulty-only toggle, cursor down, filter typed): `key_to_frame_ms`, from the key entering
           the app's input queue to the first frame composed after the redraw it caused (what the
           user waits for); and `keypress_to_screen_ms`, Pilot's press (which adds its own
           idle-detection sleeps, `unbound_key_ms_median` shows how much), with the median CPU
           time of a press (what a busy machine's other processes cannot inflate);
  memory : resident memory after an hour of updates (14,400 ticks, 2,400 redraws, run as fast
           as the machine allows), against the start. Keypresses redraw at once.

    python bench/tui.py --seconds 30 --json out.json
    python bench/tui.py --show [--hosts 64] [--gpus 8]     # just look: the live view on it, ticking
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.synthetic_fleet import SyntheticFleet
from fleet.tui.app import FleetApp
from fleet.tui.main import MainScreen
from fleet.tui.panes.gpus import GpuTable
from fleet.tui.panes.shards import ShardTable


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class TimedMain(MainScreen):
    """Records when each redraw finished (a keypress redraws from the last snapshot)."""

    def redraw(self) -> None:
        super().redraw()
        self.app.last_draw = time.perf_counter()


class TimedApp(FleetApp):
    """Also records when each frame was composed for the terminal (headless, nothing is written;
    the frame is composed all the same)."""

    last_frame = 0.0

    def get_default_screen(self) -> MainScreen:
        return TimedMain()

    def _display(self, screen, renderable) -> None:
        if renderable is not None:
            self.last_frame = time.perf_counter()
        super()._display(screen, renderable)


async def key_to_frame(app, key: str, redraws: bool) -> float:
    """Milliseconds from the key entering the app's input queue (where the terminal driver puts it)
    to the first frame composed after the redraw it caused: what the user waits for, without
    Pilot's own idle-detection sleeps (2 x 20 ms at least per press)."""
    from textual import events
    before = getattr(app, "last_draw", 0.0)
    t0 = time.perf_counter()
    app._driver.send_message(events.Key(key, key if len(key) == 1 else None))
    deadline = t0 + 5
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.0005)
        drawn = getattr(app, "last_draw", 0.0)
        if (drawn > before or not redraws) and app.last_frame > max(drawn, t0):
            return (app.last_frame - t0) * 1000
    raise AssertionError(f"no frame after {key!r}")


def lines_built(app) -> int:
    return app.main.query_one(ShardTable).lines_built + app.main.query_one(GpuTable).lines_built


async def measure(seconds: float, hour_ticks: int) -> dict:
    fleet = SyntheticFleet(hosts=64, gpus=8, seed=0, unreachable=(5,), failed=(17, 300), loop=True)
    app = TimedApp(fleet)                                       # the default 1.5 s redraw
    out: dict = {"shards": len(fleet.shards)}
    async with app.run_test(size=(200, 60)) as pilot:
        await pilot.pause(1.0)

        async def feed():
            while True:
                fleet.tick(0.25)
                await asyncio.sleep(0.25)
        feeder = asyncio.create_task(feed())
        await pilot.pause(2.0)                                  # warm
        cpu0, wall0, lines0 = time.process_time(), time.perf_counter(), lines_built(app)
        await asyncio.sleep(seconds)
        cpu1, wall1 = time.process_time(), time.perf_counter()
        out["cpu_fraction_of_one_core"] = round((cpu1 - cpu0) / (wall1 - wall0), 4)
        out["lines_built_per_s"] = round((lines_built(app) - lines0) / (wall1 - wall0))
        latencies, cpu = [], []
        keys = ["s", "f", "down", "f", "slash", "b", "escape", "s"]
        table = app.main.query_one(ShardTable)

        def moving(key: str) -> str:
            """The cursor key that moves the cursor (down on the last row changes nothing to draw)."""
            if key == "down" and table.cursor_row >= table.row_count - 1:
                return "up"
            return key
        for i in range(40):
            key = moving(keys[i % len(keys)])
            before = getattr(app, "last_draw", 0)
            t0, c0 = time.perf_counter(), time.process_time()
            await pilot.press(key)                    # returns once the screen is updated
            redrawn = getattr(app, "last_draw", 0) > before
            latencies.append((time.perf_counter() - t0) * 1000)
            cpu.append((time.process_time() - c0) * 1000)
            assert redrawn or key in ("down", "up", "slash"), key
            await pilot.pause(0.1)
        idle = []
        for _ in range(10):                           # a key bound to nothing: what Pilot's own waits cost
            t0 = time.perf_counter()
            await pilot.press("x")
            idle.append((time.perf_counter() - t0) * 1000)
        out["unbound_key_ms_median"] = round(statistics.median(idle), 1)
        direct: list[tuple[str, float]] = []
        for i in range(40):
            key = moving(keys[i % len(keys)])
            direct.append((key, await key_to_frame(app, key, key not in ("down", "up", "slash"))))
            await pilot.pause(0.1)
        ms = [m for _, m in direct]
        out["key_to_frame_ms"] = {"median": round(statistics.median(ms), 1), "max": round(max(ms), 1),
                                  "presses": len(ms),
                                  "max_by_key": {k: round(max(m for kk, m in direct if kk == k), 1)
                                                 for k in dict.fromkeys(k for k, _ in direct)}}
        out["keypress_to_screen_ms"] = {"median": round(statistics.median(latencies), 1),
                                        "max": round(max(latencies), 1), "presses": len(latencies),
                                        "cpu_median": round(statistics.median(cpu), 1)}
        feeder.cancel()
        print(json.dumps(out), file=sys.stderr, flush=True)        # the live figures, before the hour
        # An hour of updates, as fast as we can: 4 ticks a simulated second, a redraw every 1.5 s.
        rss_start = rss_mb()
        t0 = time.perf_counter()
        for n in range(hour_ticks):
            fleet.tick(0.25)
            if n % 6 == 0:
                app.draw(fleet.snapshot())
                await asyncio.sleep(0)                # let the app process what the draw posted
        out["hour"] = {"ticks": hour_ticks, "redraws": -(-hour_ticks // 6),
                       "wall_s": round(time.perf_counter() - t0, 1),
                       "rss_start_mb": round(rss_start, 1), "rss_end_mb": round(rss_mb(), 1)}
        table = app.main.query_one(ShardTable)
        out["rows"] = table.row_count
    return out


def show(hosts: int, gpus: int) -> None:
    """The live view on a synthetic fleet with a failure of every kind, ticking as it redraws."""
    n = hosts * gpus
    fleet = SyntheticFleet(hosts=hosts, gpus=gpus, unreachable=(min(5, hosts - 1),),
                           failed=tuple(k for k in (1, 17, 300) if k < n), backoff=(4,) if n > 4 else (),
                           stalled=(6,) if n > 6 else (), stopped=(2,) if n > 2 else (), loop=True)

    class Live(FleetApp):
        def on_refresh(self, message) -> None:
            fleet.tick(self.interval)
            super().on_refresh(message)
    print(Live(fleet).run() or "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--hour-ticks", type=int, default=14400)
    p.add_argument("--json", default=None)
    p.add_argument("--show", action="store_true", help="open the live view on the synthetic fleet instead")
    p.add_argument("--hosts", type=int, default=64)
    p.add_argument("--gpus", type=int, default=8)
    args = p.parse_args()
    if args.show:
        show(args.hosts, args.gpus)
        return
    result = asyncio.run(measure(args.seconds, args.hour_ticks))
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
