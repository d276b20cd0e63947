"""The shard state machine, restart policy and throughput maths, without any I/O."""

from __future__ import annotations

from fleet.config import ExpectedSpec
from fleet.state import (Host, Shard, State, backoff_delay, build_snapshot, next_action,
                         status_exit_code)


def ev(event, t, **kw):
    return {"event": event, "t": t, **kw}


def run_through(shard: Shard, events):
    for e in events:
        shard.apply(e)
    return shard


def test_happy_path_states():
    s = Shard(0, "h", 0)
    assert s.state == State.PENDING
    s.apply(ev("launch", 1, by="manual", gpu=0))
    assert s.state == State.STARTING
    s.apply(ev("started", 2, pid=42, total=10))
    s.apply(ev("loading", 2))
    assert s.state == State.LOADING
    s.apply(ev("loaded", 5))
    assert s.state == State.RUNNING
    s.apply(ev("progress", 7, done=4, total=10, tokens=400, bytes=1000))
    assert (s.done, s.tokens) == (4, 400)
    s.apply(ev("done", 9, done=10, total=10, tokens=1000, bytes=2500))
    s.apply(ev("exited", 9.1, code=0))
    assert s.state == State.DONE and s.exit_code == 0


def test_failures_and_reasons():
    s = run_through(Shard(0, "h", 0), [ev("launch", 1), ev("started", 2), ev("exited", 3, code=-9)])
    assert s.state == State.FAILED and s.reason == "killed by signal 9"
    s = run_through(Shard(0, "h", 0), [ev("launch", 1), ev("failed", 2, reason="disk full at /o"),
                                        ev("exited", 3, code=1)])
    assert s.state == State.FAILED and s.reason == "disk full at /o"
    s = run_through(Shard(0, "h", 0), [ev("launch", 1), ev("exited", 3, code=0, stopped=True)])
    assert s.state == State.FAILED and s.stopped and next_action(s, 3, True) is None


def test_vanished_process_is_failed_not_running():
    s = run_through(Shard(0, "h", 0), [ev("launch", 1), ev("loaded", 2)])
    s.set_alive(True, 7)
    s.set_alive(False)
    assert s.state == State.FAILED and "vanished" in s.reason


def test_custom_job_needs_done_sentinel_when_configured():
    s = run_through(Shard(0, "h", 0, needs_done_sentinel=True), [ev("launch", 1), ev("exited", 2, code=0)])
    assert s.state == State.FAILED and "without the done sentinel" in s.reason
    s = run_through(Shard(0, "h", 0, needs_done_sentinel=True),
                    [ev("launch", 1), ev("sentinel", 2, kind="done", line="ALL DONE"), ev("exited", 3, code=0)])
    assert s.state == State.DONE
    s = run_through(Shard(0, "h", 0), [ev("launch", 1), ev("sentinel", 2, kind="fail", line="CUDA error")])
    assert s.state == State.FAILED and "CUDA error" in s.reason


def test_restart_policy_backs_off_then_gives_up():
    assert [backoff_delay(a, 2, 60) for a in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    s = Shard(0, "h", 0)
    s.apply(ev("launch", 1, by="manual"))
    for attempt in range(3):
        s.apply(ev("exited", 2 + attempt, code=1))
        assert next_action(s, 3, True) == "restart"
        s.apply(ev("launch", 2.5 + attempt, by="auto"))
        assert s.auto_attempts == attempt + 1
    s.apply(ev("exited", 9, code=1))
    assert next_action(s, 3, True) == "fatal"
    s.apply(ev("launch", 10, by="manual"))         # a manual restart starts the count again
    assert s.auto_attempts == 0 and s.launches == 5


def test_stall_is_detected_on_host_time_and_clears():
    s = run_through(Shard(0, "h", 0), [ev("launch", 1), ev("loaded", 2), ev("progress", 10, done=1, total=5)])
    s.check_stall(100, 120)
    assert s.state == State.RUNNING
    s.check_stall(131, 120)
    assert s.state == State.STALLED and next_action(s, 3, True) == "restart"
    assert next_action(s, 3, False) is None
    s.apply(ev("progress", 132, done=2, total=5))
    s.check_stall(133, 120)
    assert s.state == State.RUNNING


def test_rates_over_the_window():
    s = run_through(Shard(0, "h", 0), [ev("launch", 0), ev("loaded", 1)])
    assert s.rates(1) is None                          # not measured yet, never zero
    for t in range(2, 12, 2):
        s.apply(ev("progress", t, done=t * 5, tokens=t * 500, bytes=t * 1000, total=1000))
    sps, tps, bps = s.rates(11)
    assert (round(sps, 6), round(tps, 6), round(bps, 6)) == (5.0, 500.0, 1000.0)


def test_snapshot_totals_unknown_hosts_and_exit_codes():
    hosts = {"a": Host("a", "1.1.1.1", reachable=True), "b": Host("b", "2.2.2.2", reachable=True)}
    shards = []
    for i, h in enumerate(("a", "a", "b")):
        s = run_through(Shard(i, h, i), [ev("launch", 0), ev("loaded", 1)])
        for t in range(2, 12, 2):
            s.apply(ev("progress", t, done=t, tokens=t * 100, bytes=t * 10, total=100))
        shards.append(s)
    exp = ExpectedSpec(samples_per_s_per_gpu=2.0, alert_ratio=0.8)
    snap = build_snapshot("r", shards, hosts, now=11, expected=exp)
    t = snap["totals"]
    assert snap["schema"] == "fleet.status/1"
    assert t["samples_per_s"] == 3.0 and t["expected_per_s"] == 6.0 and t["ratio"] == 0.5 and t["alert"]
    assert t["eta_s"] == round((300 - 30) / 3.0) and t["by_state"] == {"RUNNING": 3}
    assert status_exit_code(snap) == 0
    hosts["b"].reachable, hosts["b"].error = False, "connection refused"
    snap = build_snapshot("r", shards, hosts, now=11, expected=exp)
    row = snap["shards"][2]
    assert row["state"] == "UNKNOWN" and row["samples_per_s"] is None and "connection refused" in row["reason"]
    assert snap["hosts"][1]["gpus"] is None            # not measured, not zero
    assert status_exit_code(snap) == 3
    hosts["b"].reachable = True
    shards[0].apply(ev("exited", 12, code=1))
    assert status_exit_code(build_snapshot("r", shards, hosts, now=12, expected=exp)) == 1
