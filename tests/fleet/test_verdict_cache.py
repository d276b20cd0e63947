"""The store judges a shard again only when what the judge reads of it changes (fleet/verdicts.py):
counted through the real store over a stream of agent messages as a host link reads them (JSON
lines through `protocol.parse_message`), and a verdict from the cache is always the one a fresh
`judge(...)` gives at that moment, over random message sequences (hypothesis)."""

from __future__ import annotations

import json
import os
import types

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fleet.store as store_module
from fleet.config import load_config
from fleet.engine import make_launcher
from fleet.judge import LaunchFailure, Policy, judge
from fleet.plan import make_plan
from fleet.state import State
from fleet.store import Store
from fleet.transport import HostError
from worker import protocol as p

HOSTS, GPUS = 2, 2


class Clock:
    """The store's clocks (wall and monotonic), moved by the test."""

    def __init__(self, t: float = 1_000_000.0):
        self.t = t

    def time(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t - 900_000.0


def make_store(tmp: str, policy: Policy, clock: Clock, monkeypatch=None) -> Store:
    path = os.path.join(tmp, "fleet.toml")
    with open(path, "w") as f:
        f.write('[run]\nname = "cache"\nmodel = "m"\ndata = "d"\noutput = "out"\n' +
                "".join(f'\n[[hosts]]\nname = "h{i}"\naddress = "10.0.0.{i + 1}"\ngpus = {list(range(GPUS))}\n'
                        for i in range(HOSTS)))
    config = load_config(path)
    engine = make_launcher(config)
    store = Store(config, policy, engine)
    store.use_plan(make_plan(config, engine.place({h.name: list(range(GPUS)) for h in config.hosts}), engine.kind, {}))
    for host in store.hosts:
        read(store, host, p.Hello(protocol=p.PROTOCOL_VERSION, t=clock.t), clock)
        store.hosts[host].up()
    return store


def read(store: Store, host: str, msg: p.Message, clock: Clock):
    """One agent line, as `fleet.follow` reads it: JSON, parsed into its message, applied."""
    parsed = p.parse_message(json.dumps(msg.to_dict()))
    assert parsed is not None, msg
    return store.apply(host, parsed, now=clock.t)


def event(shard: int, ev: p.Record) -> p.EventMessage:
    return p.EventMessage(shard=shard, event=ev)


def fresh(store: Store, k: int, now: float):
    """The judge asked directly, from the shard as the store holds it now: no cache."""
    s = store.shards[k]
    host = store.hosts[s.placement.host]
    return judge(s.record, s.alive, host.host_now(now), store.policy, tuple(s.launch_failures), s.task,
                 s.acting, s.idle(), host.down_reason)


@pytest.fixture
def counted(monkeypatch):
    """Every call of the judge the store makes, counted; the store's clocks the test's."""
    calls = []
    real = store_module.judge

    def counting(*args, **kw):
        calls.append(args[0])
        return real(*args, **kw)
    clock = Clock()
    monkeypatch.setattr(store_module, "judge", counting)
    monkeypatch.setattr(store_module, "time", types.SimpleNamespace(time=clock.time, monotonic=clock.monotonic))
    return calls, clock


def running(store: Store, clock: Clock, gap: float = 5.0) -> None:
    """Every shard launched, loaded and past four batches `gap` s apart (its usual interval)."""
    t0 = clock.t - 60
    for s in store.shards.values():
        host = s.placement.host
        for ev in (p.Launch(t=t0, launch=1, gpu=s.placement.gpu), p.Started(t=t0 + 1, launch=1, pid=100 + s.id),
                   p.Loaded(t=t0 + 2, launch=1)):
            read(store, host, event(s.id, ev), clock)
        for i in range(4):
            read(store, host, event(s.id, p.Progress(t=clock.t - gap * (3 - i), launch=1, done=10 * (i + 1),
                                                      total=1000)), clock)
        read(store, host, p.Liveness(shard=s.id, alive=True, pid=100 + s.id, t=clock.t, acting=False,
                                     idle_s=0.0), clock)
    for host in store.hosts:
        read(store, host, p.Replayed(t=clock.t), clock)


def telemetry(store: Store, clock: Clock) -> None:
    """What an agent sends every interval whatever its shards do: GPU and disk readings, a beat,
    each live shard's liveness (unchanged but its idle time) and its idle line."""
    for host in store.hosts:
        mine = [s for s in store.shards.values() if s.placement.host == host]
        gpus = [p.GpuStat(index=s.placement.gpu, util=97.0, mem_used=70 << 30, mem_total=80 << 30) for s in mine]
        read(store, host, p.GpuReading(t=clock.t, source="nvml", gpus=gpus), clock)
        read(store, host, p.DiskReading(t=clock.t, path="/out", free=1 << 40, total=2 << 40), clock)
        read(store, host, p.Beat(t=clock.t), clock)
        idle = [clock.t - s.record.attempt.last_progress_t for s in mine]
        for s, idle_s in zip(mine, idle):
            read(store, host, p.Liveness(shard=s.id, alive=True, pid=100 + s.id, t=clock.t, acting=False,
                                         idle_s=idle_s), clock)
        read(store, host, p.Idle(shards=[s.id for s in mine], idle_s=idle), clock)


def test_readings_and_beats_never_judge_a_shard_again(tmp_path, counted):
    """Thirty seconds of readings, beats, liveness and idle lines (17 lines a second a host), four
    decide passes and a picture a second: every shard judged once, then again only when its
    silence makes it LATE (past 15 s: three of its usual 5 s intervals); LATE's words count
    seconds, so from then on it is judged at each read."""
    calls, clock = counted
    store = make_store(str(tmp_path), Policy(stall_timeout=120.0), clock)
    running(store, clock)
    n, last_progress = len(store.shards), clock.t
    seen: list[tuple[float, int, set]] = []
    for step in range(4 * 30):
        clock.t += 0.25
        telemetry(store, clock)
        for s in store.shards.values():                 # the decide pass
            assert store.verdict(s, clock.t) == fresh(store, s.id, clock.t)
        if step % 4 == 0:
            store.snapshot(clock.t)                     # the picture reads the same verdicts
        seen.append((clock.t - last_progress, len(calls), {store.judged[k].verdict.state for k in store.shards}))
    quiet = [(c, states) for age, c, states in seen if age <= 15.0]
    assert len(quiet) == 60 and all(c == n and states == {State.RUNNING} for c, states in quiet), quiet
    late = [(c, states) for age, c, states in seen if age > 15.0]
    assert all(states == {State.LATE} for _, states in late)
    assert all(b - a >= n for (a, _), (b, _) in zip(late, late[1:]))     # each LATE read judged


def test_a_backoff_is_judged_again_when_its_restart_is_due_and_not_before(tmp_path, counted):
    calls, clock = counted
    store = make_store(str(tmp_path), Policy(backoff_base=4.0, backoff_max=60.0), clock)
    running(store, clock)
    s = store.shards[0]
    read(store, s.placement.host, event(0, p.Exited(t=clock.t, launch=1, code=1)), clock)
    read(store, s.placement.host, p.Liveness(shard=0, alive=False, t=clock.t), clock)
    v = store.verdict(s, clock.t)
    assert v.state == State.BACKOFF and v.action.value == "none" and v.due_t == clock.t + 4.0
    before = len(calls)
    for _ in range(15):                                 # 3.75 s of readings: not due yet
        clock.t += 0.25
        telemetry_without(store, clock, dead={0})
        assert store.verdict(s, clock.t) == v
    assert len(calls) == before
    clock.t += 0.25                                     # due
    assert store.verdict(s, clock.t).action.value == "restart"
    assert len(calls) == before + 1
    assert store.verdict(s, clock.t + 10) == fresh(store, 0, clock.t + 10) and len(calls) == before + 1


def telemetry_without(store: Store, clock: Clock, dead: set[int]) -> None:
    for host in store.hosts:
        read(store, host, p.GpuReading(t=clock.t, source="nvml"), clock)
        read(store, host, p.Beat(t=clock.t), clock)
        for s in store.shards.values():
            if s.placement.host == host and s.id in dead:
                read(store, host, p.Liveness(shard=s.id, alive=False, t=clock.t), clock)


def test_a_host_down_and_back_is_judged_again_each_time(tmp_path, counted):
    calls, clock = counted
    store = make_store(str(tmp_path), Policy(), clock)
    running(store, clock)
    s = store.shards[0]
    assert store.verdict(s, clock.t).state == State.RUNNING
    store.hosts["h0"].down(HostError("h0: connection refused"), now=clock.t)
    down = store.verdict(s, clock.t + 1)
    assert down.state == State.UNKNOWN and down.recorded == State.RUNNING
    before = len(calls)
    for i in range(40):                              # its words say the state alone: no second needed
        assert store.verdict(s, clock.t + 1 + i * 0.25) == down
    assert len(calls) == before
    store.hosts["h0"].up()
    assert store.verdict(s, clock.t + 11).state == State.RUNNING and len(calls) == before + 1


# --- a verdict from the cache is the judge's, whatever the messages ------------------------------

TIME = st.tuples(st.just("time"), st.sampled_from([0.05, 0.25, 0.5, 1.0, 2.5, 4.0, 9.0, 16.0, 31.0, 65.0]))
EVENT = st.tuples(st.just("event"), st.sampled_from(
    ["launch", "launch_auto", "launch_task", "started", "loading", "loaded", "progress", "progress", "failed",
     "fatal", "fail_line", "done", "exit0", "exit1", "killed", "vanished", "stop", "restart", "submitted",
     "task_end"]))
STEPS = st.lists(st.one_of(
    TIME, TIME, EVENT, EVENT,
    st.tuples(st.just("alive"), st.sampled_from([True, False, None])),
    st.tuples(st.just("acting"), st.sampled_from([True, False, None])),
    st.tuples(st.just("idle"), st.sampled_from([0.0, 3.0, 14.0, 20.0, 50.0])),
    st.tuples(st.just("task"), st.tuples(st.sampled_from(["queued", "running", "ending", "ended"]),
                                         st.sampled_from([None, "Priority", "Resources"]))),
    st.tuples(st.just("telemetry"), st.just(None)),
    st.tuples(st.just("launch_failed"), st.sampled_from(["auto", "manual"])),
    st.tuples(st.just("host"), st.sampled_from(["down", "up", "offset"])),
), max_size=40)
QUEUED = [("event", "launch_task"), ("event", "submitted"), ("task", ("queued", "Priority"))]
RUNNING = [("event", "launch"), ("event", "started"), ("event", "loaded")] + \
    [("event", "progress"), ("time", 4.0)] * 4 + [("alive", True)]
SLOW = [("event", "launch"), ("event", "started"), ("event", "loaded")] + \
    [("event", "progress"), ("time", 16.0)] * 4 + [("alive", True)]
OPENINGS = st.sampled_from([
    [],
    RUNNING,                                                                # LATE past 12 s, STALLED past 30
    SLOW,                                                                   # STALLED (30 s) before LATE (48)
    RUNNING[:3],                                                            # warming up: STALLED past 30
    RUNNING + [("host", "down")],                                           # UNKNOWN: RUNNING, LATE, STALLED
    RUNNING + [("time", 31.0), ("host", "down")],                           # UNKNOWN: STALLED (or giving up)
    RUNNING + [("event", "stop")],                                          # SIGKILL in 5 s
    RUNNING + [("event", "stop"), ("acting", False)],                       # ... overdue 30 s after it
    RUNNING + [("event", "restart"), ("event", "killed")],                  # the restart's handoff
    RUNNING + [("event", "exit1"), ("alive", False)],                       # a backoff
    QUEUED,                                                                 # the engine's reason
    [("event", "launch_task"), ("event", "submitted"), ("event", "started"), ("event", "killed")],  # the engine's word
])


class Agent:
    """One shard's host, sending what its agent would: events of its record, liveness, idle
    times, the engine's word, readings."""

    def __init__(self, store: Store, clock: Clock):
        self.store, self.clock = store, clock
        self.n = 0
        self.done = 0
        self.offset = 0.0

    @property
    def host_t(self) -> float:
        return self.clock.t + self.offset

    def send(self, msg: p.Message) -> None:
        read(self.store, "h0", msg, self.clock)

    def ev(self, ev: p.Record) -> None:
        self.send(event(0, ev))

    def step(self, kind: str, arg) -> None:
        t, n = self.host_t, self.n
        if kind == "time":
            self.clock.t += arg
        elif kind == "event":
            self.event(arg, t, n)
        elif kind == "alive":
            s = self.store.shards[0]
            self.send(p.Liveness(shard=0, alive=bool(arg), pid=7 if arg else None, t=t,
                                 acting=s.acting, idle_s=None if arg else 0.0))   # (silence: the stamps')
        elif kind == "acting":
            s = self.store.shards[0]
            self.send(p.Liveness(shard=0, alive=bool(s.alive), pid=s.pid, t=t, acting=arg, idle_s=s.idle_s))
        elif kind == "idle":
            self.send(p.Idle(shards=[0], idle_s=[arg]))
        elif kind == "task":
            phase, reason = arg
            self.send(p.TaskState(shard=0, launch=n or None, job="j1", phase=phase, state=phase.upper(),
                                  reason=reason, t=t))
        elif kind == "telemetry":
            self.send(p.GpuReading(t=t, source="nvml", gpus=[p.GpuStat(index=0, util=90)]))
            self.send(p.DiskReading(t=t, path="/out", free=1 << 30, total=1 << 31))
            self.send(p.Beat(t=t))
        elif kind == "launch_failed":
            self.store.shards[0].launch_failed(LaunchFailure(t, arg, "ssh: connection reset"))
        elif kind == "host":
            self.host(arg)

    def host(self, arg: str) -> None:
        host = self.store.hosts["h0"]
        if arg == "down":
            host.down(HostError("h0: connection refused"), now=self.clock.t)
        elif arg == "up":
            host.up()
        else:                                     # its clock found a second ahead of what we thought
            self.offset += 1.0
            self.send(p.Beat(t=self.host_t))

    def event(self, arg: str, t: float, n: int) -> None:
        if arg.startswith("launch"):
            self.n += 1
            self.ev(p.Launch(t=t, launch=self.n, by="auto" if arg == "launch_auto" else "manual", gpu=0,
                             launcher="engine" if arg == "launch_task" else None))
        elif n == 0:
            return
        elif arg == "progress":
            self.done += 1
            self.ev(p.Progress(t=t, launch=n, done=self.done, total=100, tokens=self.done * 10))
        elif arg in ("failed", "fatal"):
            self.ev(p.Failed(t=t, launch=n, reason="boom", fatal=arg == "fatal"))
        elif arg == "fail_line":
            self.ev(p.Sentinel(t=t, launch=n, match="fail", line="Traceback"))
        elif arg == "done":
            self.ev(p.Done(t=t, launch=n, done=self.done, total=100))
        elif arg.startswith("exit") or arg in ("killed", "vanished"):
            self.ev(p.Exited(t=t, launch=n, code={"exit0": 0, "exit1": 1, "killed": -9}.get(arg),
                             vanished=arg == "vanished"))
        elif arg in ("stop", "restart"):
            self.ev(p.StopRequested(t=t, launch=n, why="user" if arg == "stop" else "restart",
                                    then="launch" if arg == "restart" else None, grace=5.0, reason="stalled"))
        elif arg == "submitted":
            self.ev(p.Submitted(t=t, launch=n, job="j1"))
        elif arg == "task_end":
            self.ev(p.TaskEnded(t=t, launch=n, job="j1", end="preempted", state="PREEMPTED"))
        else:
            cls = {"started": p.Started, "loading": p.Loading, "loaded": p.Loaded}[arg]
            self.ev(cls(t=t, launch=n, **({"pid": 7} if arg == "started" else {})))


@settings(max_examples=600, deadline=None)
@example(opening=QUEUED, steps=[("task", ("queued", "Resources"))], custom_job=False, restart_stalled=True,
         stall=30.0, max_restarts=2, reads=2)                               # the reason the engine gives changes
@example(opening=RUNNING + [("time", 31.0), ("host", "down")], steps=[("idle", 0.0)], custom_job=False,
         restart_stalled=True, stall=30.0, max_restarts=0, reads=1)       # given up, unread; its host says it moved
@given(opening=OPENINGS, steps=STEPS, custom_job=st.booleans(), restart_stalled=st.booleans(),
       stall=st.sampled_from([30.0, None]), max_restarts=st.sampled_from([0, 2]), reads=st.integers(1, 3))
def test_a_verdict_from_the_cache_is_the_judges_over_any_message_sequence(tmp_path_factory, opening, steps, custom_job,
                                                                          restart_stalled, stall, max_restarts, reads):
    """After every message, read as often as a decide pass, a picture and a refusal would; then,
    nothing more said, read on as time alone passes every threshold."""
    clock = Clock()
    policy = Policy(max_restarts=max_restarts, backoff_base=1.0, backoff_max=8.0, stall_timeout=stall,
                    restart_stalled=restart_stalled, custom_job=custom_job)
    real_time = store_module.time
    store_module.time = types.SimpleNamespace(time=clock.time, monotonic=clock.monotonic)
    try:
        store = make_store(str(tmp_path_factory.mktemp("cache")), policy, clock)
        agent = Agent(store, clock)
        agent.send(p.Replayed(t=clock.t))
        for kind, arg in opening + steps:
            agent.step(kind, arg)
            shard = store.shards[0]
            for i in range(reads):                  # the decide pass, the picture, a refusal
                now = clock.t + 0.3 * i
                assert store.verdict(shard, now) == fresh(store, 0, now), (kind, arg)
        for later in (0.5, 0.5, 2.0, 3.0, 4.0, 3.0, 7.0, 11.0, 14.0, 25.0, 30.0):
            clock.t += later
            assert store.verdict(store.shards[0], clock.t) == fresh(store, 0, clock.t), later
    finally:
        store_module.time = real_time
