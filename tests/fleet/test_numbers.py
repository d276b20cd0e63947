"""Honest numbers: the snapshot's rates, expected figure, ETAs (fleet-wide and per shard) in tokens
when known, elapsed and averages of a finished run, money; the throughput history rebuilt from the
records; and the notices a [notify] command and the live view's toasts are told. Pure code, typed
events in, snapshot fields out."""

from __future__ import annotations

import pytest

from fleet.config import ExpectedSpec
from fleet.judge import STALL_SHOWN_S, Policy, judge, rates, throughput_history
from fleet.notify import alert_notice, notices
from fleet.record import fold
from fleet.snapshot import ShardView, build_snapshot
from fleet.hosts import Host
from fleet.store import changes
from fleet.state import State
from worker import protocol as p

POLICY = Policy(max_restarts=3, backoff_base=2, backoff_max=60, stall_timeout=120)


def launch(t, n=1, by="manual"):
    return p.Launch(t=t, launch=n, by=by, gpu=0)


def running(total=100, total_tokens=None, until=11, tokens_per_sample=100, start=0):
    """A shard making 1 sample (100 tokens) a second from t=start+2 to t=until, in steps of 2 s."""
    evs = [launch(start), p.Loaded(t=start + 1, launch=1)]
    for t in range(start + 2, until + 1, 2):
        n = t - start
        evs.append(p.Progress(t=t, launch=1, done=n, total=total, tokens=n * tokens_per_sample,
                              bytes=n * 10, total_tokens=total_tokens))
    return evs


def view(k, host, events, now, alive=True, policy=POLICY, down=None):
    """The shard as the store gives it to the snapshot (`down`: why its host cannot be read)."""
    r = fold(events)
    return ShardView(k, host, k, r, judge(r, alive, now, policy, host_down=down), alive, None, policy.max_restarts)


def hosts(**prices):
    return {name: Host(name, "10.0.0.1", reachable=True, replayed=True, usd_per_hour=prices.get(name))
            for name in ("a", "b")}


EXP = ExpectedSpec(samples_per_s_per_gpu=1.0, alert_ratio=0.8)
NOEXP = ExpectedSpec()                              # no expected figure: no alerts


def test_expected_is_per_gpu_times_gpus_planned_and_a_failure_lowers_the_ratio_never_raises_it():
    h = hosts()
    shards = [view(k, "a", running(), 10) for k in range(4)]
    t = build_snapshot("r", shards, h, 10, EXP).totals
    assert (t.gpus_planned, t.gpus_expected, t.expected_per_s, t.ratio) == (4, 4, 4.0, 1.0)
    # Shard 3 dies for good: it still should be working, so expected stays and the ratio drops.
    dead = view(3, "a", running() + [p.Failed(t=10, launch=1, reason="boom", fatal=True),
                                     p.Exited(t=10, launch=1, code=1)], 10, alive=False)
    t = build_snapshot("r", shards[:3] + [dead], h, 10, EXP).totals
    assert t.by_state == {"RUNNING": 3, "FATAL": 1}
    assert (t.gpus_expected, t.expected_per_s, t.ratio, t.alert_level) == (4, 4.0, 0.75, "low")
    # DONE (nothing left), STOPPED (on purpose) and UNKNOWN (not measured) leave both sides.
    done = view(2, "a", running() + [p.Done(t=10, launch=1, done=100, total=100), p.Exited(t=10, launch=1, code=0)],
                10, alive=False)
    stopped = view(1, "a", running() + [p.StopRequested(t=10, launch=1), p.Exited(t=10, launch=1, code=-15)],
                   10, alive=False)
    t = build_snapshot("r", [shards[0], stopped, done, dead], h, 10, EXP).totals
    assert (t.gpus_planned, t.gpus_expected, t.expected_per_s, t.ratio) == (4, 2, 2.0, 0.5)
    h["b"].reachable = False
    t = build_snapshot("r", [shards[0], view(1, "b", running(), 10, down=h["b"].down_reason)], h, 10, EXP).totals
    assert (t.gpus_planned, t.gpus_expected, t.by_state) == (2, 1, {"RUNNING": 1, "UNKNOWN": 1})
    # A shard over two GPUs (gpus_per_shard = 2) is expected to do two GPUs' work.
    wide = ShardView(0, "a", 0, fold(running()), judge(fold(running()), True, 10, POLICY), True, None, 3, gpus=(0, 1))
    t = build_snapshot("r", [wide], h, 10, EXP).totals
    assert (t.gpus_planned, t.gpus_expected, t.expected_per_s, t.ratio) == (2, 2, 2.0, 0.5)


def test_tokens_once_known_ratio_eta_and_per_shard_eta():
    h = hosts()
    # Samples only: ETA and ratio in samples.
    t = build_snapshot("r", [view(0, "a", running(), 10)], h, 10, EXP).totals
    assert (t.eta_unit, t.ratio_unit, t.total_tokens, t.expected_tokens_per_s) == ("samples", "samples", None, None)
    # Shard 0 knows its tokens: 100 samples of 150 tokens on average; it runs 100 tokens a second
    # (short samples now, so samples/s says 1.0 while the tokens left are many more).
    a = view(0, "a", running(total_tokens=15000), 10)
    snap = build_snapshot("r", [a], h, 10, EXP)
    s, t = snap.shards[0], snap.totals
    assert (s.total_tokens, s.tokens, s.tokens_per_s, s.samples_per_s) == (15000, 1000, 100.0, 1.0)
    assert s.eta_s == (15000 - 1000) / 100          # in tokens: 140 s, where samples would say 90 s
    assert (t.eta_unit, t.eta_s, t.total_tokens, t.tokens) == ("tokens", 140, 15000, 1000)
    # The samples figure becomes tokens through the run's tokens per sample (150): 150 tok/s expected.
    assert (t.ratio_unit, t.expected_tokens_per_s, t.ratio) == ("tokens", 150.0, round(100 / 150, 3))
    # One unfinished shard without its total: the fleet's ETA falls back to samples, its own too.
    b = view(1, "a", running(), 10)
    snap = build_snapshot("r", [a, b], h, 10, EXP)
    assert snap.totals.eta_unit == "samples" and snap.totals.total_tokens is None
    assert snap.shards[1].eta_s == 90.0 and snap.shards[0].eta_s == 140.0
    # The run ends when its last shard does: 140 s here, not the 90 s of the fleet's pooled rate.
    c = view(1, "a", running(total_tokens=4000), 10)
    snap = build_snapshot("r", [a, c], h, 10, EXP)
    assert [x.eta_s for x in snap.shards] == [140, 30] and snap.totals.eta_s == 140
    # A configured tokens figure is compared as it is.
    t = build_snapshot("r", [b], h, 10, ExpectedSpec(tokens_per_s_per_gpu=200)).totals
    assert (t.ratio_unit, t.expected_per_s, t.expected_tokens_per_s, t.ratio) == ("tokens", 200.0, 200.0, 0.5)


def test_rates_only_while_running_fall_to_zero_and_restart_from_nothing():
    evs = running(until=20)
    r = fold(evs)
    assert rates(r, State.LOADING, 20) is None and rates(r, State.STARTING, 20) is None
    # A frozen worker (SIGSTOP): its rate only ever falls, to zero, never rises before the stall.
    seen = [rates(r, State.RUNNING, now).samples_per_s for now in range(20, 80, 3)]
    assert seen == sorted(seen, reverse=True) and seen[-1] == 0.0 and seen[0] == 1.0
    # A restart: the new attempt has no rate until it has progress of its own.
    evs += [p.Exited(t=21, launch=1, code=-9), launch(23, n=2, by="auto"), p.Loaded(t=24, launch=2),
            p.Progress(t=25, launch=2, done=20, total=100)]
    assert rates(fold(evs), State.RUNNING, 26) is None
    # Sparse points (a replay keeps one a minute): work before the window is not counted in it.
    sparse = [launch(0), p.Loaded(t=1, launch=1), p.Progress(t=2, launch=1, done=0, total=1000),
              p.Progress(t=62, launch=1, done=600, total=1000), p.Progress(t=92, launch=1, done=900, total=1000)]
    assert rates(fold(sparse), State.RUNNING, 92).samples_per_s == pytest.approx(10.0)


def test_a_stall_is_shown_before_its_restart_even_with_no_backoff():
    evs = [launch(0), p.Loaded(t=1, launch=1), p.Progress(t=10, launch=1, done=1, total=5)]
    quick = Policy(max_restarts=3, backoff_base=0.01, backoff_max=0.01, stall_timeout=120)
    v = judge(fold(evs), True, 130.5, quick)
    assert v.state == State.STALLED and v.due_t == 130 + STALL_SHOWN_S and v.action.value == "none"
    assert judge(fold(evs), True, 130 + STALL_SHOWN_S, quick).action.value == "restart"


def test_a_finished_run_freezes_elapsed_gives_averages_and_what_it_cost():
    h = hosts(a=8.0, b=4.0)
    h["b"].clock_offset = 5.0                       # b's clock runs 5 s ahead of the supervisor's
    a = running(total=10, total_tokens=1000, until=10)
    a += [p.Done(t=12, launch=1, done=10, total=10, tokens=1000, total_tokens=1000), p.Exited(t=12, launch=1, code=0)]
    b = [launch(5), p.Loaded(t=6, launch=1), p.Progress(t=8, launch=1, done=5, total=10, tokens=500, total_tokens=1000),
         p.Done(t=25, launch=1, done=10, total=10, tokens=1000, total_tokens=1000), p.Exited(t=25, launch=1, code=0)]
    views = [view(0, "a", a, 3600, alive=False), view(1, "b", b, 3600, alive=False)]
    t = build_snapshot("r", views, h, 3600, EXP).totals
    assert t.finished and t.settled and t.eta_s == 0
    assert t.elapsed_s == 20.0                      # first launch 0 to b's end at 25 - 5 = 20, an hour later
    assert (t.avg_samples_per_s, t.avg_tokens_per_s, t.avg_tokens_per_s_per_gpu) == (1.0, 100.0, 50.0)
    assert t.usd_per_hour == 12.0 and t.usd_spent == round(12 * 20 / 3600, 2) == t.usd_projected
    assert t.usd_per_million_tokens == round(12 * 20 / 3600 / 2000 * 1e6, 3)
    snap = build_snapshot("r", views, h, 3600, EXP)
    assert [x.usd_spent for x in snap.hosts] == [round(8 * 20 / 3600, 2), round(4 * 20 / 3600, 2)]


def test_money_while_running_projects_the_rest_at_the_current_rate():
    h = hosts(a=36.0)
    snap = build_snapshot("r", [view(0, "a", running(total_tokens=15000), 10)], h, 10, EXP)
    t = snap.totals
    assert t.elapsed_s == 10 and t.usd_spent == 0.1 and t.eta_s == 140
    assert t.usd_projected == round(0.1 + 36 * 140 / 3600, 2)
    assert t.usd_per_million_tokens == 100.0        # $0.10 for 1,000 tokens
    assert snap.hosts[0].usd_spent == 0.1 and snap.hosts[1].usd_per_hour is None
    assert build_snapshot("r", [view(0, "a", running(), 10)], hosts(), 10, EXP).totals.usd_spent is None


def test_throughput_history_is_rebuilt_from_the_records_without_inventing_work():
    a = fold(running(until=40))                     # 100 tokens/s from t=2 to t=40
    b = fold(running(until=40, start=20))           # another from t=22 on, clock 10 s ahead
    history = throughput_history([(a, 0.0), (b, 10.0)], now=40, step=10, points=4)
    assert [t for t, _, _ in history] == [10, 20, 30, 40]
    # a: 100/s throughout (flat before its first point); b's points are at 12..30 on this clock.
    assert [round(tok) for _, tok, _ in history] == [80, 180, 200, 100]
    assert [round(smp, 2) for _, _, smp in history] == [0.8, 1.8, 2.0, 1.0]
    assert throughput_history([(fold([launch(0)]), 0.0)], 40, 10, 2) == [(30, 0.0, 0.0), (40, 0.0, 0.0)]


def told(shown: dict, snap) -> list:
    """What a decide pass publishes for this picture (`fleet.store.changes`, as the store calls it
    with the shown states), and the notices that makes."""
    return notices(changes(shown, [(s.id, s.state, s.failures) for s in snap.shards], snap.time), snap)


def test_notices_tell_changes_seen_while_watching_once_each():
    h = hosts()
    ok = [view(k, "a", running(), 10) for k in range(2)]
    shown: dict = {}
    assert told(shown, build_snapshot("r", ok, h, 10, NOEXP)) == []    # history before watching: silent
    # Shard 0 fails and goes straight to BACKOFF: told once as FAILED, with why.
    failed = running() + [p.Exited(t=11, launch=1, code=-9)]
    snap = build_snapshot("r", [view(0, "a", failed, 11, alive=False), ok[1]], h, 11, NOEXP)
    now = told(shown, snap)
    assert [(n.event, n.shard.id, n.previous) for n in now] == [("FAILED", 0, "RUNNING")]
    assert "killed by signal 9" in now[0].message and now[0].schema_ == "fleet.notify/1"
    assert told(shown, snap) == []                  # nothing new, nothing told
    # Then it gives up: FATAL, once.
    fatal = failed + [launch(13, 2, "auto"), p.Failed(t=14, launch=2, reason="boom", fatal=True),
                      p.Exited(t=14, launch=2, code=1)]
    now = told(shown, build_snapshot("r", [view(0, "a", fatal, 14, alive=False), ok[1]], h, 14, NOEXP))
    assert [n.event for n in now] == ["FATAL"]
    # Every shard DONE: each DONE, then the run's end.
    done = [view(k, "a", running(total=10) + [p.Done(t=15, launch=1, done=10, total=10),
                                              p.Exited(t=15, launch=1, code=0)], 15, alive=False) for k in range(2)]
    now = told(shown, build_snapshot("r", done, h, 16, NOEXP))
    assert [n.event for n in now] == ["DONE", "DONE", "finished"]
    assert "2/2 shards DONE" in now[-1].message and "fleet verify" in now[-1].message


def test_a_failure_whose_restart_came_before_anyone_looked_is_still_told():
    """BACKOFF -> (relaunched, failed again) -> BACKOFF between two passes: the same state, one
    more failure: told as FAILED."""
    h = hosts()
    once = running() + [p.Exited(t=11, launch=1, code=1)]
    shown: dict = {}
    told(shown, build_snapshot("r", [view(0, "a", once, 12, alive=False)], h, 12, NOEXP))
    twice = once + [launch(13, 2, "auto"), p.Exited(t=14, launch=2, code=1)]
    snap = build_snapshot("r", [view(0, "a", twice, 14.5, alive=False)], h, 14.5, NOEXP)
    assert snap.shards[0].state == State.BACKOFF
    assert [(n.event, n.previous) for n in told(shown, snap)] == [("FAILED", "BACKOFF")]


def test_an_alert_is_told_only_once_it_has_held():
    h = hosts()
    slow = ExpectedSpec(samples_per_s_per_gpu=4.0, alert_ratio=0.8)       # 1 of 4: critical
    snaps = [build_snapshot("r", [view(0, "a", running(until=t), t)], h, t, slow) for t in (10, 40, 70, 100)]
    seen = None
    told_at = []
    for snap in snaps:
        notice, seen = alert_notice(seen, snap, alert_after=60)
        told_at += [(snap.time, notice.event, notice.previous)] if notice else []
    assert snaps[0].totals.alert_level == "critical"
    assert told_at == [(70, "alert", "ok")]        # 60 s after it was first seen low


# --- invariants over many histories (hypothesis) ---------------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

from fleet.judge import RATE_WINDOW_S, STALE_BATCHES  # noqa: E402


@st.composite
def progress_histories(draw):
    """One attempt's progress: times strictly rising, counters never falling."""
    steps = draw(st.lists(st.tuples(st.floats(0.01, 90), st.integers(0, 50)), min_size=2, max_size=30))
    evs, t, done = [launch(0), p.Loaded(t=0.5, launch=1)], 1.0, 0
    for dt, n in steps:
        t, done = t + dt, done + n
        evs.append(p.Progress(t=t, launch=1, done=done, total=10**6, tokens=done * 7))
    return evs, t


@settings(max_examples=200, deadline=None)
@given(progress_histories(), st.floats(0, 200), st.floats(0, 200))
def test_a_rate_is_never_negative_and_only_falls_once_progress_stops(history, wait1, wait2):
    evs, last = history
    r = fold(evs)
    first, later = sorted((wait1, wait2))
    a, b = (rates(r, State.RUNNING, last + w) for w in (first, later))
    assert a.samples_per_s >= 0 and a.tokens_per_s == pytest.approx(7 * a.samples_per_s)
    assert b.samples_per_s <= a.samples_per_s + 1e-9                    # decays, never rises
    times = [e.t for e in evs[2:]]
    moved = [t for t, e, before in zip(times[1:], evs[3:], evs[2:]) if e.done != before.done]
    ends = [times[0]] + moved                                           # the batches, as written
    gaps = [y - x for x, y in zip(ends, ends[1:])]
    if gaps and later >= max(RATE_WINDOW_S, STALE_BATCHES * max(gaps)):
        assert b.samples_per_s == 0.0                                   # no batch for the window and 4 usual
    if gaps and first <= min(gaps) and ends[-1] == last:
        assert a.samples_per_s > 0                                      # the next batch is not late: never 0
    for state in (State.PENDING, State.STARTING, State.LOADING, State.DONE, State.FAILED, State.STOPPED):
        assert rates(r, state, last + first) is None                    # counted only while RUNNING


@settings(max_examples=300, deadline=None)
@given(st.integers(20, 400))
def test_id_and_state_always_fit_and_the_columns_fill_the_width_exactly(width):
    from fleet.tui.panes.lines import fit_columns
    from fleet.tui.panes.shards import COLUMNS
    layout = fit_columns(COLUMNS, width)
    keys = [c.key for c, _ in layout]
    assert keys[0] == "id" and "state" in keys
    assert sum(w for _, w in layout) + len(layout) - 1 == width
    assert all(w >= c.width or c.flex for c, w in layout)               # only the reason is ever cut
    if width >= 51:
        assert {"progress", "tps", "reason"} <= set(keys)
    ranks = sorted(c.priority for c, _ in layout)
    assert ranks == list(range(len(ranks)))                             # none skipped for a lesser one


def test_a_shard_waiting_to_restart_counts_at_the_mean_rate_and_one_given_up_not_at_all():
    """The run's ETA while a shard is in BACKOFF (killed, restart pending): its work is still to do,
    at the rate the measured shards make each; a FATAL or STOPPED shard will not finish."""
    h = hosts()
    fast = view(0, "a", running(total_tokens=3000), 10)                   # 20 s left at 100 tok/s
    killed = view(1, "a", running(total_tokens=30000) + [p.Exited(t=10, launch=1, code=-9)], 10,
                  alive=False)
    snap = build_snapshot("r", [fast, killed], h, 10, EXP)
    assert [x.state for x in snap.shards] == [State.RUNNING, State.BACKOFF]
    assert snap.shards[1].eta_s is None
    assert snap.totals.eta_s == (30000 - 1000) / 100                      # not (2000 + 29000) / 100
    fatal = view(1, "a", running(total_tokens=30000) + [p.Failed(t=10, launch=1, reason="x", fatal=True),
                                                        p.Exited(t=10, launch=1, code=1)], 10, alive=False)
    snap = build_snapshot("r", [fast, fatal], h, 10, EXP)
    assert snap.shards[1].state == State.FATAL and snap.totals.eta_s == 20
    assert build_snapshot("r", [killed], h, 10, EXP).totals.eta_s is None  # nothing measured: unknown


def test_the_chart_fills_its_width_with_a_short_run_and_bridges_only_short_gaps():
    """A 40 s run gets columns that span it (not a sliver of 10 s ones at the right edge); an hour gets
    columns spanning it; a reading missing between two others is drawn at the earlier one, the time
    before the first reading and after the last stays empty."""
    from fleet.tui.panes.throughput import bucket_for, columns
    short = [(t, 100.0) for t in (0.0, 1.5, 3.0, 4.5, 40.0)]
    assert 40.0 <= bucket_for(short, 40.0, 100) * 100 <= 40.0 * 4 / 3   # the axis fits the run (issue 25)
    assert 3600.0 <= bucket_for([(0.0, 1.0)], 3600.0, 100) * 100 <= 3600.0 * 4 / 3
    assert bucket_for([(0.0, 1.0)], 86400.0, 100) == 60.0                     # the widest: a day shows its last 100 min
    cols = columns(short, 40.0, 100, 1.0)
    assert cols[:60] == [None] * 60                          # before the run
    assert cols[60:65] == [100.0] * 5                        # 1.5 s apart: column 62 bridged
    assert cols[65:99] == [None] * 34 and cols[99] == 100.0  # 35 s apart: a gap, not a line
