"""A synthetic fleet for the TUI: real ShardRecords, the real judge and the real build_snapshot, fed
the events of runs recorded from the real worker and runner instead of SSH. Used by the TUI
benchmark (64 hosts x 8 GPUs) and by visual snapshot and key tests. Deterministic for a given seed
and clock.

Every event a shard gets was written by a real producer (`tests/data/runs/`, made by
`bench/record_runs.py` and the README's demo: `python -m worker.extract` on the tiny demo model,
under `worker/hostctl.py`'s runner and the real supervisor); the fleet only moves it in time (each
shard's run starts at its own moment, the same few records multiplied over many shards), numbers
its launches as the shard's own and puts it on the shard's GPU:

  demo-0.jsonl, demo-1.jsonl   two whole runs of 1,200 length-sorted rows, each ends DONE: what a
                               healthy shard replays (samples/s climbs as rows shorten, tokens/s holds);
  restarts-0.jsonl             launch 1 killed by SIGKILL at 310 rows (exited -9), launch 2 (auto)
                               resumes: a shard in BACKOFF replays launch 1, `kill` its exit;
  restarts-1.jsonl             launch 1 stopped by the user (`stop` why=user, exited stopped), launch 2
                               by `fleet up`, restarted by `fleet restart` (`stop` why=restart), launch 3
                               to DONE: the ends of `stop` and `restart`, and the opening of a launch a
                               user asked for;
  fatal-0.jsonl                a model with a weight missing: `failed` fatal=true while loading (FATAL).

Like the supervisor's decide pass, it tells its subscribers (the live view's toasts) which shards
changed state, computed by the store's own `changes`. A user's restart launches the shard again with the opening of a recorded manual launch, then
resumes the shard's own run where it stopped (the worker resumes from its manifest), at the pace
that run was recorded at. Actions land at the moment they are asked (the recorded stop ends took
a second or two). A STALLED shard is one whose next events never arrive while its process lives;
an unreachable host's shards get no events after the start. GPU readings are made up (the records
were made on a CPU), and so is the log `follow_log` streams.

It imports no UI: `python bench/tui.py --show` opens the live view on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import random
import sys
from collections import deque

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fleet.actions import refusal
from fleet.config import ExpectedSpec
from fleet.judge import Policy, judge, throughput_history
from fleet.record import ShardRecord
from fleet.schema import Disk, FleetSnapshot, Gpu
from fleet.snapshot import ShardView, build_snapshot
from fleet.state import State
from fleet.hosts import Host
from fleet.store import Transition, changes
from worker import protocol

RUNS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "runs")
CLEAN = ("demo-0.jsonl", "demo-1.jsonl")
KILLED = "restarts-0.jsonl"
USER = "restarts-1.jsonl"
FATAL = "fatal-0.jsonl"
# What is left of a run once its launch has loaded: resumed by the next launch.
RUN_REST = (protocol.Progress, protocol.SampleSkipped, protocol.WarningEvent, protocol.Exited)


@functools.cache
def recorded(name: str) -> tuple[protocol.Record, ...]:
    """The typed events of one recorded shard, as its events.jsonl holds them."""
    events = (protocol.parse_event(d) for d in protocol.iter_jsonl(os.path.join(RUNS, name)))
    return tuple(e for e in events if e is not None)


@functools.cache
def attempt(name: str, n: int) -> tuple[protocol.Record, ...]:
    """The events of launch n of a recorded shard, in order."""
    return tuple(e for e in recorded(name) if getattr(e, "launch", None) == n)


def opening(events) -> tuple[protocol.Record, ...]:
    """From the launch up to the model loaded (or the attempt's end, if it never loaded)."""
    end = next((i for i, e in enumerate(events) if isinstance(e, protocol.Loaded)), len(events) - 1)
    return tuple(events[:end + 1])


def after_opening(events) -> tuple[protocol.Record, ...]:
    """What a launch did after loading: its progress, done and exit."""
    return tuple(events[len(opening(events)):])


def ending(events, kind: type) -> tuple[protocol.Record, ...]:
    """An attempt's end from its first event of `kind` (a stop's intent, the exit), progress left out."""
    start = next(i for i, e in enumerate(events) if isinstance(e, kind))
    return tuple(e for e in events[start:] if not isinstance(e, protocol.Progress))


def first_sample_t(events) -> float:
    return next(e.t for e in events if isinstance(e, protocol.Progress) and e.done > 0)


class SyntheticFleet:
    def __init__(self, hosts: int = 64, gpus: int = 8, seed: int = 0,
                 start: float = 1_700_000_000.0, unreachable: tuple[int, ...] = (),
                 failed: tuple[int, ...] = (), backoff: tuple[int, ...] = (), stalled: tuple[int, ...] = (),
                 stopped: tuple[int, ...] = (), log_lines: int = 30, telemetry: bool = True,
                 usd_per_gpu_hour: float | None = 2.5, loop: bool = False):
        """failed: FATAL (a recorded model-load failure a restart would meet again); backoff: the
        recorded kill -9, 10 s ago, its restart due in 50 s; stalled: alive, no progress for 500 s;
        stopped: stopped by a user (the recorded stop). Healthy shards are 5-30% into a recorded
        run. loop: a shard whose run ended DONE starts the run again in a fresh record (the next
        run of the fleet), so that a benchmark's hour has events all along; healthy shards are then
        anywhere in their run, so that they do not all load at once."""
        self.rng = random.Random(seed)
        self.now = start
        self.expected = ExpectedSpec(samples_per_s_per_gpu=8, alert_ratio=0.8)   # the demo's fleet.toml
        self.policy = Policy(max_restarts=3, backoff_base=60, backoff_max=60, stall_timeout=120)
        self.hosts: dict[str, Host] = {}
        self.shards: list[tuple[str, int, ShardRecord]] = []
        self.alive: list[bool] = []
        self.log_lines = log_lines
        self.loop = loop
        self.pending: list[deque[tuple[float, protocol.Record]]] = []   # (when, event) still to come
        self.held: list[tuple[protocol.Record, ...]] = []     # the run's rest, after a failure or stop
        self.runs: list[str] = []                             # the clean run each shard replays
        self.exit_code: list[int | None] = []                 # of each shard's last exit
        self.events: list[list[protocol.Record]] = []        # each shard's events.jsonl, as written
        self.stalled = set(stalled)
        self.listeners: list = []                             # the live view's, told of transitions
        self.shown: dict[int, tuple[State, int]] = {}         # what was last told, as the store keeps it
        for h in range(hosts):
            name = f"box{h:02d}"
            host = Host(name, f"10.0.{h // 250}.{h % 250 + 1}", reachable=h not in unreachable,
                        error="connection refused" if h in unreachable else None,
                        telemetry="nvml" if telemetry else "none", gpu_t=start, last_seen=start,
                        replayed=True, disk=Disk(path="/workspace/hs", free=12 * 10**12, total=30 * 10**12),
                        usd_per_hour=None if usd_per_gpu_hour is None else usd_per_gpu_hour * gpus)
            if telemetry:
                host.gpus = [Gpu(index=g, name="NVIDIA H200", uuid=f"GPU-{h}-{g}", mem_used=int((60 + g) * 2**30),
                                 mem_total=150754820096, util=90 + g % 10, temp=60 + g, power_w=550.0 + g,
                                 power_limit_w=700.0) for g in range(gpus)]
            self.hosts[name] = host
            for g in range(gpus):
                self.shards.append((name, g, ShardRecord()))
                self.alive.append(False)
                self.pending.append(deque())
                self.held.append(())
                self.runs.append(self.rng.choice(CLEAN))
                self.exit_code.append(None)
                self.events.append([])
        for k in range(len(self.shards)):
            if k in failed:
                self._begin(k, recorded(FATAL), end_at=start - 30)
                self.held[k] = after_opening(attempt(self.runs[k], 1))
            elif k in backoff:
                self._begin(k, attempt(KILLED, 1), end_at=start - 10)
                self.held[k] = after_opening(attempt(KILLED, 2))
            else:
                run = recorded(self.runs[k])
                first, last = first_sample_t(run), run[-1].t
                into = self.rng.uniform(*((0.0, 0.95) if loop else (0.05, 0.3)))  # looping: spread out
                at = first + 1 + into * (last - first)                            # into the run, now
                self._begin(k, run, shift=(start - 500 if k in stalled else start) - at)
            self._apply(k, start - 500 if k in stalled else start)
        for k in stopped:
            self._stop_now(k, attempt(USER, 1))
        self.tick(0)

    # --- replaying ---------------------------------------------------------------------------------
    def _begin(self, k: int, events, shift: float | None = None, end_at: float | None = None) -> None:
        """Schedule recorded events for shard k, moved by `shift` seconds (or so the last is at end_at)."""
        if shift is None:
            shift = end_at - events[-1].t
        self.pending[k].extend((e.t + shift, e) for e in events)

    def _apply(self, k: int, until: float) -> None:
        """Shard k's scheduled events up to `until`, as its host would have written them."""
        q = self.pending[k]
        while q and q[0][0] <= until:
            t, e = q.popleft()
            self._record(k, e, t)

    def _record(self, k: int, e: protocol.Record, t: float) -> None:
        """One event into shard k's record, at time t, numbered as its launch, on its GPU."""
        _, g, r = self.shards[k]
        n = r.launches + 1 if isinstance(e, protocol.Launch) else r.launches
        changes = {"t": t, "launch": n}
        if isinstance(e, protocol.Launch):
            changes["gpu"] = g
        e = dataclasses.replace(e, **changes)
        self.events[k].append(e)
        r.apply(e)
        if isinstance(e, protocol.Launch):
            self.alive[k] = True
        elif isinstance(e, protocol.Exited):
            self.alive[k], self.exit_code[k] = False, e.code

    def _end_now(self, k: int, end) -> None:
        """Shard k's current launch ends now as a recorded one did; the rest of its run is held."""
        rest = tuple(e for _, e in self.pending[k] if isinstance(e, RUN_REST))
        self.held[k] = rest or self.held[k]
        self.pending[k].clear()
        for e in end:
            self._record(k, e, self.now)

    def _stop_now(self, k: int, recorded_attempt) -> None:
        self._end_now(k, ending(recorded_attempt, protocol.StopRequested))

    def _launch_now(self, k: int) -> None:
        """A launch the user asked for: a recorded manual launch's opening from now, then the rest
        of the shard's run where it stopped, after the gap the recorded launch had before its first
        progress."""
        relaunch = attempt(USER, 3)
        head = opening(relaunch)
        self._begin(k, head, shift=self.now - head[0].t)
        rest, self.held[k] = self.held[k], ()
        if rest:
            gap = next(e.t for e in relaunch if isinstance(e, protocol.Progress)) - head[-1].t
            self._begin(k, rest, shift=self.now + (head[-1].t - head[0].t) + gap - rest[0].t)
        self._apply(k, self.now)

    def tick(self, dt: float = 1.0) -> None:
        """Advance the clock by dt seconds: every shard gets what its host recorded in that time, GPUs
        move like real ones (utilisation, power and memory jitter every second)."""
        second = int(self.now + dt) != int(self.now)
        self.now += dt
        if second:
            for host in self.hosts.values():
                host.gpu_t = self.now
                for g in host.gpus:
                    g.util = self.rng.randint(85, 100)
                    g.power_w = round(self.rng.uniform(500, 700), 1)
                    g.mem_used = int(self.rng.uniform(60, 70) * 2**30)
        for k, (host, _, r) in enumerate(self.shards):
            if k in self.stalled or not self.hosts[host].reachable:
                continue
            self._apply(k, self.now)
            if self.loop and not self.pending[k] and not self.alive[k] and self.exit_code[k] == 0:
                self._again(k)
        self._publish()

    def _transitions(self) -> list[Transition]:
        """What changed since the last call, as the supervisor's decide pass computes it."""
        current = [(k, self.verdict(k).state, r.failures) for k, (_, _, r) in enumerate(self.shards)]
        return changes(self.shown, current, self.now)

    def verdict(self, k: int):
        """The judge's verdict on shard k, its host's state given as the supervisor gives it."""
        host, _, r = self.shards[k]
        return judge(r, self.alive[k], self.now, self.policy, host_down=self.hosts[host].down_reason)

    def _publish(self) -> None:
        if self.listeners and (told := self._transitions()):
            for listener in self.listeners:
                listener(told)

    def subscribe(self, listener) -> None:
        """`listener` gets the shards' transitions from now on (what was before is not news)."""
        if not self.listeners:
            self._transitions()
        self.listeners.append(listener)

    def _again(self, k: int) -> None:
        host, gpu, _ = self.shards[k]
        self.shards[k], self.events[k] = (host, gpu, ShardRecord()), []
        self._begin(k, recorded(self.runs[k]), shift=self.now - recorded(self.runs[k])[0].t)
        self._apply(k, self.now)

    def kill(self, k: int) -> None:
        """Shard k's worker is killed by SIGKILL now (the recorded kill -9: its runner's exit -9)."""
        self._end_now(k, ending(attempt(KILLED, 1), protocol.Exited))
        self._publish()

    def finish(self, ids=None) -> None:
        """Bring shards (default: every live one) to DONE: each is a recorded run that ended now."""
        for k in (range(len(self.shards)) if ids is None else ids):
            if not self.alive[k]:
                continue
            host, gpu, _ = self.shards[k]
            self.shards[k], self.events[k] = (host, gpu, ShardRecord()), []
            self.pending[k].clear()
            self.stalled.discard(k)
            self._begin(k, recorded(self.runs[k]), end_at=self.now)
            self._apply(k, self.now)
        self._publish()

    # --- the FleetSource -----------------------------------------------------------------------------
    def snapshot(self) -> FleetSnapshot:
        views = [ShardView(k, host, gpu, r, self.verdict(k), self.alive[k], None, self.policy.max_restarts)
                 for k, (host, gpu, r) in enumerate(self.shards)]
        return build_snapshot("synthetic", views, self.hosts, self.now, self.expected)

    async def history(self, step: float, points: int) -> list[tuple[float, float, float]]:
        return throughput_history([(r, self.hosts[h].clock_offset) for h, _, r in self.shards],
                                  self.now, step, points)

    def refusal(self, k: int, kind: str) -> str | None:
        v = self.verdict(k)
        return refusal(kind, v.state, k, why=v.reason)

    async def restart(self, ids: list[int]) -> list[str]:
        for k in ids:
            if self.alive[k]:
                self._stop_now(k, attempt(USER, 2))           # the recorded `fleet restart`'s stop
            self.stalled.discard(k)
            self._launch_now(k)
        self._publish()
        return [f"shard {k}: started" for k in ids]

    async def stop(self, ids: list[int]) -> list[str]:
        for k in ids:
            self._stop_now(k, attempt(USER, 1))
        self._publish()
        return [f"shard {k}: stopped" for k in ids]

    async def stop_all(self) -> list[str]:
        return await self.stop([k for k in range(len(self.shards)) if self.alive[k]])

    async def follow_log(self, shard: int):
        for n in range(self.log_lines):
            yield f"[shard {shard}] progress total=20000 done={n * 35} tokens={n * 25480}"
        yield f"[shard {shard}] warning message=flash-linear-attention not installed: slow GDN kernels"
        await asyncio.Event().wait()          # a quiet, healthy stream
        yield ""
