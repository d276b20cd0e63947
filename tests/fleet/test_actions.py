"""Every stop and restart through the one action path, over many cycles, with real processes: the
real runner (worker.hostctl) starting a scripted [job] that hangs, ignores SIGTERM or forks, the real
agent following the record, the real supervisor judging and acting, and a second supervisor (or the
CLI in another process) acting beside it. The invariants of fleet/actions.py are checked on the
host's own truth: the record and the processes holding the shard's lock."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet.config import load_config
from fleet.state import SETTLED, State
from fleet.supervisor import Supervisor
from worker import hostctl, protocol

from .test_records import due_later, file_events, job_toml, shard, started, until


def shard_dir(tmp_path, k: int) -> str:
    return str(tmp_path / "fleet" / "job" / "shards" / str(k))


def live_launches(tmp_path, k: int) -> set[int]:
    """The launch numbers of every process of shard k (runner, job, forks: by their environment)."""
    out = set()
    for pid in hostctl.shard_processes(shard_dir(tmp_path, k)):
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        for kv in env:
            if kv.startswith(protocol.LAUNCH_ENV.encode() + b"="):
                out.add(int(kv.split(b"=", 1)[1]))
    return out


def launches(tmp_path, k: int) -> list[protocol.Launch]:
    return [e for e in file_events(tmp_path, k) if isinstance(e, protocol.Launch)]


async def nothing_left(tmp_path, k: int) -> None:
    await until(lambda: not hostctl.shard_processes(shard_dir(tmp_path, k)), timeout=30, what="no process left")


@pytest.mark.parametrize("behaviour", [
    [["chatter"]],                                          # lives and logs, no progress
    [["ignore_term"], ["fork", "group"], ["chatter"]],       # needs SIGKILL; a child in its group
    [["fork", "setsid"], ["chatter"]],                      # a child that left its group
])
async def test_a_hung_shard_is_restarted_every_time_then_fatal_with_nothing_left(tmp_path, behaviour):
    script = {"0": [[["progress", 1, 9], *behaviour]]}
    logs: list[str] = []
    sup = await started(job_toml(tmp_path, script, gpus=(0,), max_restarts=2, backoff="0.2s",
                                 stall="1s", grace="0.5s"), logs)
    try:
        await until(lambda: shard(sup, 0).state == State.FATAL, timeout=90, what="FATAL")
        s = shard(sup, 0)
        assert s.reason.startswith("gave up after 2 restart(s); last: no progress for")
        assert [e.by for e in launches(tmp_path, 0)] == ["manual", "auto", "auto"]
        await nothing_left(tmp_path, 0)
        await until(lambda: shard(sup, 0).alive is False, what="the agent sees it dead")
        # Each attempt was ended by an intent recorded before its signal: two restarts, then the stop
        # that gave up.
        stops = [e for e in file_events(tmp_path, 0) if isinstance(e, protocol.StopRequested)]
        assert [(e.launch, e.why, e.then) for e in stops] == [(1, "restart", "launch"), (2, "restart", "launch"),
                                                             (3, "fatal", None)]
        # The third attempt's end reaches the store with its runner's exit event, which may come
        # a moment after the agent has seen the process gone (`alive`): wait for it, then 3 exactly.
        await until(lambda: shard(sup, 0).failures >= 3, timeout=30, what="the third attempt's end read")
        assert shard(sup, 0).failures == 3
        verdict, action = due_later(sup, 0)                   # FATAL: nothing more is tried
        assert (verdict.state, action) == (State.FATAL, None)
        assert len(launches(tmp_path, 0)) == 3 and shard(sup, 0).state == State.FATAL
    finally:
        await sup.close()
        await Supervisor(load_config(str(tmp_path / "fleet.toml"))).stop_all(timeout=1)


async def test_fleet_down_during_a_backoff_leaves_nothing_running_and_nothing_relaunched(tmp_path):
    script = {"0": [[["progress", 1, 9], ["exit", 3]]], "1": [[["progress", 1, 9], ["ignore_term"], ["hang"]]]}
    sup = await started(job_toml(tmp_path, script, backoff="3s", grace="0.5s"))
    try:
        await until(lambda: shard(sup, 0).state == State.BACKOFF, what="shard 0 waiting to restart")
        await until(lambda: shard(sup, 1).done == 1, what="shard 1 running")
        other = Supervisor(load_config(str(tmp_path / "fleet.toml")))   # `fleet down` from a shell
        await other.read_once()
        results = await other.stop_all(timeout=0.5)
        await other.close()
        assert [(r.host, r.shards, r.error) for r in results] == [("local", {0: "not running", 1: "killed"}, None)]
        await until(lambda: [shard(sup, k).state for k in (0, 1)] == [State.STOPPED, State.STOPPED],
                    what="both STOPPED")
        for k in (0, 1):                                      # long past shard 0's backoff
            verdict, action = due_later(sup, k)
            assert (verdict.state, action) == (State.STOPPED, None)
        assert [len(launches(tmp_path, k)) for k in (0, 1)] == [1, 1]
        assert [shard(sup, k).state for k in (0, 1)] == [State.STOPPED, State.STOPPED]
        for k in (0, 1):
            await nothing_left(tmp_path, k)
    finally:
        await sup.close()


async def test_fleet_restart_beside_an_attached_supervisor_launches_exactly_once(tmp_path):
    script = {"0": [[["progress", 1, 9], ["ignore_term"], ["chatter"]], [["progress", 2, 9], ["hang"]]]}
    logs: list[str] = []
    config = job_toml(tmp_path, script, gpus=(0,), backoff="0.2s", grace="1s")
    sup = await started(config, logs)
    try:
        await until(lambda: shard(sup, 0).done == 1, what="running")
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fleet", "restart", "0", "-c", config,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        seen_stopping = await until(lambda: shard(sup, 0).state == State.STOPPING, what="STOPPING")
        out, err = await cli.communicate()
        assert cli.returncode == 0, err.decode()
        assert "shard 0: started (launch 2)" in out.decode()
        await until(lambda: shard(sup, 0).done == 2, what="the new launch running")
        await until(lambda: not sup.acting, what="the attached supervisor idle")
        verdict, action = due_later(sup, 0, ahead=30)         # within stall_timeout: nothing to do
        assert (verdict.state, action) == (State.RUNNING, None)
        ls = launches(tmp_path, 0)
        assert [(e.launch, e.by) for e in ls] == [(1, "manual"), (2, "manual")]
        s = shard(sup, 0)
        assert seen_stopping and s.state == State.RUNNING and s.failures == 0 and s.last_failure is None
        assert live_launches(tmp_path, 0) == {2}
        assert not any("restart: started" in m for m in logs)      # the attached one never launched it
    finally:
        await sup.close()
        await Supervisor(load_config(config)).stop_all(timeout=1)


async def test_the_same_rule_for_every_caller_and_a_users_restart_is_no_failure(tmp_path):
    script = {"0": [[["progress", 2, 2], ["print", "extract-only mode"], ["exit", 0]]],
              "1": [[["progress", 1, 9], ["hang"]], [["progress", 2, 9], ["hang"]]]}
    config = job_toml(tmp_path, script, grace="0.5s")
    sup = await started(config)
    try:
        await until(lambda: shard(sup, 0).state == State.DONE and shard(sup, 1).done == 1, what="DONE and running")
        r = await sup.request([0, 1], "restart")
        assert r[0].status == "refused" and "DONE: nothing to redo" in r[0].detail
        assert r[1].status == "restarting"
        await until(lambda: shard(sup, 1).done == 2, what="restarted")
        s = shard(sup, 1)
        assert (s.failures, s.last_failure, s.restarts) == (0, None, 1)
        cli = subprocess.run([sys.executable, "-m", "fleet", "restart", "0", "-c", config],
                             capture_output=True, text=True)
        assert cli.returncode == 1 and "DONE: nothing to redo" in cli.stderr
        assert (await sup.request([0], "stop"))[0].status == "refused"
    finally:
        await sup.close()
        await Supervisor(load_config(config)).stop_all(timeout=1)


# --- invariants over random sequences, with real processes --------------------------------------

STEPS = st.lists(st.sampled_from(["user_stop", "user_restart", "kill9", "run_stop", "second_restart",
                                  "wait"]), min_size=2, max_size=5)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(steps=STEPS)
def test_invariants_hold_after_every_step(tmp_path_factory, steps):
    """At most the processes of one launch per shard; nothing alive once DONE, FATAL or STOPPED;
    a user's (or the run's) stop is never undone by the policy; a user's restart is no failure."""
    tmp_path = tmp_path_factory.mktemp("seq")
    script = {"0": [[["progress", 1, 9], ["ignore_term"], ["fork", "group"], ["chatter"]]]}
    config = job_toml(tmp_path, script, gpus=(0,), max_restarts=2, backoff="0.3s", stall="2s", grace="0.3s")
    asyncio.run(_run_steps(tmp_path, config, steps))


async def _run_steps(tmp_path, config: str, steps: list[str]) -> None:
    sup = await started(config)
    stopped_at: int | None = None            # launches when the user's stop was carried out
    try:
        await until(lambda: shard(sup, 0).done >= 1, what="running")
        for step in steps:
            k = shard(sup, 0)
            if step == "user_stop" and sup.refusal(0, "stop") is None:
                await sup.request([0], "stop", wait=20)
                stopped_at = len(launches(tmp_path, 0))
            elif step == "user_restart" and sup.refusal(0, "restart") is None:
                await sup.request([0], "restart", wait=20)
                stopped_at = None
            elif step == "second_restart":            # another supervisor's restart of what it judged
                other = Supervisor(load_config(config))
                await other.read_once()
                if other.refusal(0, "restart") is None:
                    await other.request([0], "restart", wait=20)
                    stopped_at = None
                await other.close()
            elif step == "run_stop":
                other = Supervisor(load_config(config))
                await other.read_once()
                await other.stop_all(timeout=0.3)
                await other.close()
                stopped_at = len(launches(tmp_path, 0))
            elif step == "kill9" and k.pid:
                try:
                    os.kill(k.pid, 9)
                except ProcessLookupError:
                    pass
            await asyncio.sleep(1.0)
            assert len(live_launches(tmp_path, 0)) <= 1
            if stopped_at is not None:
                assert len(launches(tmp_path, 0)) == stopped_at, "a stop was undone"
            s = shard(sup, 0)
            if s.state in SETTLED:
                await until(lambda: not hostctl.shard_processes(shard_dir(tmp_path, 0)), timeout=20,
                            what=f"no process in {s.state.value}")
    finally:
        await sup.close()
        await Supervisor(load_config(config)).stop_all(timeout=0.3)


async def test_a_job_that_forks_a_daemon_and_exits_is_done_with_nothing_left(tmp_path):
    """A [job] that double-forks a daemon (its own session, SIGTERM ignored) and then finishes: DONE,
    and the daemon is killed with the launch — no process of the shard outlives it."""
    script = {"0": [[["fork", "setsid"], ["progress", 9, 9], ["print", "extract-only mode"], ["exit", 0]]]}
    sup = await started(job_toml(tmp_path, script, gpus=(0,)))
    try:
        await until(lambda: shard(sup, 0).state == State.DONE, what="DONE")
        await nothing_left(tmp_path, 0)
        log = (tmp_path / "fleet" / "job" / "shards" / "0" / "log").read_text()
        assert "launch 1: 1 process(es) it left behind were killed" in log or \
               "left behind were killed" in log, log
        assert shard(sup, 0).state == State.DONE
    finally:
        await sup.close()


async def test_a_record_truncated_under_a_live_shard_never_launches_it_twice(tmp_path):
    script = {"0": [[["progress", 1, 9], ["hang"]]]}
    config = job_toml(tmp_path, script, gpus=(0,))
    sup = await started(config)
    await until(lambda: shard(sup, 0).done == 1, what="running")
    await sup.close()
    open(os.path.join(shard_dir(tmp_path, 0), "events.jsonl"), "w").close()     # truncated, unwatched
    logs: list[str] = []
    sup = await started(config, logs)
    try:
        await until(lambda: shard(sup, 0).state == State.UNKNOWN, what="UNKNOWN: record lost")
        assert "record has no launch" in shard(sup, 0).reason
        verdict, action = due_later(sup, 0)
        assert (verdict.state, action) == (State.UNKNOWN, None)
        assert live_launches(tmp_path, 0) == {1} and not launches(tmp_path, 0)   # nothing launched
        assert not any("launch" in m and "running" in m for m in logs), logs
    finally:
        await sup.close()
        await Supervisor(load_config(config)).stop_all(timeout=1)
    await nothing_left(tmp_path, 0)



def test_a_stop_of_a_shard_long_ended_never_signals_the_process_its_stale_pid_files_name(tmp_path):
    """A pid file outlives its process; its number, reused, may belong to any process of the host. A
    stop of an ended shard whose pid and runner files name a stranger — a process leading a group of
    its own, with a child in it, as a test worker does — signals neither, and says it was not running."""
    run_dir = str(tmp_path / "fleet" / "job")
    d = protocol.shard_dir(run_dir, 0)
    hostctl.launch(d, protocol.LaunchSpec(argv=[sys.executable, "-c", "pass"]), by="user")
    deadline = time.monotonic() + 30
    while hostctl.is_running(d) or hostctl.shard_processes(d):
        assert time.monotonic() < deadline, "the one-line shard never ended"
        time.sleep(0.05)
    stranger = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                                 "subprocess.Popen(['sleep', '600']); time.sleep(600)"], start_new_session=True)
    try:
        for name in (protocol.PID_FILE, hostctl.RUNNER_PID_FILE):
            with open(os.path.join(d, name), "w") as f:
                f.write(f"{stranger.pid}\n")
        assert hostctl.kill_shard(d, grace=0.5) == "not running"
        result = hostctl.act(run_dir, protocol.ShardAction(shard=0, kind="stop", why="user", grace=0.5))
        assert result.status == "not running", result
        time.sleep(1)
        os.killpg(stranger.pid, 0)                 # its group is still there: raises if it was killed
        assert stranger.poll() is None, "the stranger named by a stale pid file was killed"
    finally:
        os.killpg(stranger.pid, 9)
        stranger.wait()
