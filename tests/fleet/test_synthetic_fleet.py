"""The synthetic fleet (bench/synthetic_fleet.py), which feeds the TUI key and snapshot tests and the
TUI benchmark, replays what real producers wrote (tests/data/runs/) and invents no event: checked
on every event it writes, through the states of a troubled fleet, a user's restarts and stops, a
kill and a finish."""

from __future__ import annotations

import asyncio
import json

from bench.synthetic_fleet import CLEAN, FATAL, KILLED, USER, SyntheticFleet, recorded
from fleet.judge import judge
from fleet.record import fold
from fleet.state import State
from worker import protocol

MOVED = ("t", "launch", "gpu")          # what the replay may change: when, the launch's number, the GPU


def content(e: protocol.Record) -> str:
    d = e.to_dict()
    return json.dumps({k: v for k, v in d.items() if k not in MOVED}, sort_keys=True)


RECORDED = {content(e) for name in (*CLEAN, KILLED, USER, FATAL) for e in recorded(name)}


def exercised() -> SyntheticFleet:
    f = SyntheticFleet(hosts=3, gpus=4, seed=5, unreachable=(2,), failed=(1,), backoff=(4,), stalled=(6,),
                       stopped=(2,))
    for _ in range(20):
        f.tick(1.0)
    asyncio.run(f.restart([0, 1, 4, 6]))         # running, FATAL, BACKOFF, STALLED
    f.kill(3)
    asyncio.run(f.stop([5]))
    for _ in range(30):
        f.tick(2.0)
    asyncio.run(f.restart([2, 3]))               # STOPPED, killed
    f.tick(400.0)                                # every run to its end
    f.finish([7])
    return f


def test_every_event_written_is_one_a_real_producer_wrote():
    f = exercised()
    written = [e for events in f.events for e in events]
    assert len(written) > 500
    invented = [e for e in written if content(e) not in RECORDED]
    assert invented == []


def test_every_launch_starts_before_its_progress_and_no_started_claims_total_tokens():
    f = exercised()
    for k, events in enumerate(f.events):
        launches = [e.launch for e in events if isinstance(e, protocol.Launch)]
        assert launches == list(range(1, len(launches) + 1)), k
        assert [e.t for e in events] == sorted(e.t for e in events), k
        for n in launches:
            kinds = [e.KIND for e in events if e.launch == n]
            assert kinds[0] == "launch", (k, n, kinds)
            if "progress" in kinds:
                assert kinds.index("started") < kinds.index("progress"), (k, n, kinds)
        assert not any(isinstance(e, protocol.Started) and e.total_tokens for e in events), k


def test_a_restart_resumes_the_shard_where_it_was_and_every_shard_ends_as_its_record_says():
    f = exercised()
    for k, events in enumerate(f.events):
        done = [e.done for e in events if isinstance(e, protocol.Progress)]
        assert done == sorted(done), k                             # resumed, never started over
    states = [s.state for s in f.snapshot().shards]
    # Every run played to its end is DONE, the one stopped stays STOPPED; the unreachable host's
    # shards heard nothing.
    assert states[:8] == [State.DONE] * 5 + [State.STOPPED] + [State.DONE] * 2
    assert set(states[8:]) == {State.UNKNOWN}
    assert [e.by for e in f.events[4] if isinstance(e, protocol.Launch)] == ["manual", "manual"]
    assert [(e.why, e.then) for e in f.events[0] if isinstance(e, protocol.StopRequested)] == [("restart", "launch")]
    assert any(isinstance(e, protocol.Exited) and e.code == -9 for e in f.events[3])


def test_the_troubled_fleet_is_judged_the_same_from_its_written_record(tmp_path):
    """What the live view is shown equals the judge on the events as a host's events.jsonl holds
    them (written and read back), for the states of every kind."""
    f = SyntheticFleet(hosts=3, gpus=4, seed=7, unreachable=(2,), failed=(1,), backoff=(4,), stalled=(6,),
                       stopped=(2,))
    for _ in range(30):
        f.tick(1.0)
    shown = f.snapshot().shards
    assert [s.state for s in shown[:8]] == [State.RUNNING, State.FATAL, State.STOPPED, State.RUNNING,
                                            State.BACKOFF, State.RUNNING, State.STALLED, State.RUNNING]
    for k in range(8):
        path = tmp_path / f"{k}.jsonl"
        for e in f.events[k]:
            protocol.append_jsonl(str(path), e, sync=False)
        v = judge(fold(protocol.read_events(str(path))), f.alive[k], f.now, f.policy)
        assert (v.state, v.reason) == (shown[k].state, shown[k].reason), k
    assert "weight(s) missing" in shown[1].reason and "killed by signal 9" in shown[4].reason
