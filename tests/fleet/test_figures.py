"""The ETA and the progress age (fleet/figures.py) against runs recorded from the real worker.

`tests/data/runs/` holds the events.jsonl of real runs, replayed here prefix by prefix:
- `demo-{0,1}.jsonl`: the two shards of the README's demo (`fleet up --headless` on the top-level
  fleet.toml, 1,200 length-sorted rows each) from before the worker reported its work's cost: they
  still fold, and their ETA is the pace of completed batches, as before.
- `demo-cost-{a,b}-{0,1}.jsonl`: the same demo, twice, with the worker that reports the cost of its
  work (rows, tokens, tokens squared, done and total; `batches_from`); `long-sorted.jsonl`: one
  shard of the demo's model over 180 pre-tokenized rows of 12 to 3,709 tokens, longest first
  (`long-sorted.toml`, `worker.demo.make_token_dataset(path, 180, 500, mean_tokens=700, seed=1,
  max_tokens=4000)`), the per-token cost falling about 2.5x from the first rows to the last. All
  recorded on the 2-core development machine while other sessions' tests ran on it (load average
  6-9), every run recorded is here.
- `demo-timed-{a,b,c}-{0,1}.jsonl`: the demo again (`bench/record_eta_runs.sh`), with the worker
  that times each batch from when its rows were counted (`counted_t`) and measures attention's
  weight at load on the CPU instead of sending the FLOP model's: run a on the machine as it was
  (another session's helper at work on it), b beside one run of the fast test lane, c beside three
  (load average 6-7). Every run recorded is here.

The run, for "from the first tenth on", is the shard's extraction from when its first batch began
(`batches_from`) to when its last row was written: before that the shard is LOADING (model, rows,
first batch) and has no ETA by design; after it the worker finishes (the speculators format's
prepared index, the skip check: 9 s of the demo's 140 on the busy machine) before its `done`,
which the ETA does not count (it reads 0 then). The last seconds: 20% of what is left falls under one batch there, and progress
only moves a batch at a time, so the bound is 20% or one batch (the longest interval between two
moves of the counters seen so far), whichever is larger."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fleet.config import ExpectedSpec
from fleet.figures import batches, fit_cost, nnls_toward, pace, pace_eta, progress_age
from fleet.judge import Policy, Rates, _at, judge, rates
from fleet.record import ShardRecord, fold
from fleet.snapshot import ShardView, build_snapshot, shard_eta
from fleet.state import State
from fleet.hosts import Host
from tests.worker.test_leases import run_pool, shard_events
from worker import protocol
from worker.demo import make_token_dataset

RUNS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "runs")


def recorded(name: str) -> list[protocol.Record]:
    return protocol.read_events(os.path.join(RUNS, name))


def checkpoints(events: list[protocol.Record]):
    """(time, events up to it, seconds really left) from 15% of the attempt (two batches in: one
    batch says nothing of a pace) to its end."""
    start = next(e.t for e in events if isinstance(e, protocol.Loaded))
    end = next(e.t for e in events if isinstance(e, protocol.Done))
    for i in range(15, 96, 5):
        t = start + (end - start) * i / 100
        yield t, [e for e in events if e.t <= t], end - t


def batch_ends(history) -> list[tuple]:
    """What judge.rates read off the whole history before the record kept it as it folded:
    (count time, samples, tokens, bytes) of the first point and of every point where the counters
    moved (a batch written)."""
    out: list[tuple] = []
    for t, samples, tokens, nbytes, _sq, counted in history:
        point = (counted, samples, tokens, nbytes)
        if not out or point[1:] != out[-1][1:]:
            out.append(point)
    return out


def window_rates(record: ShardRecord, now: float, window: float = 30.0) -> Rates:
    """The issue's 30 s window, as rates were measured before they counted batches: the work of the
    last `window` s up to now (interpolated between progress points), over the window."""
    h = record.attempt.history
    start = max(now - window, h[0][0])
    return Rates(*((h[-1][i] - _at(h, start, i)) / (now - start) for i in (1, 2, 3)))


def test_the_eta_of_recorded_runs_holds_steadier_and_nearer_than_the_30s_window():
    """Replayed every 5% from 15% on: the predicted end never moves by half the time left between
    two checkpoints (the 30 s window's did: 5m35s -> 26m19s at a steady rate in the issue) and is
    nearer the time really left, in total, than the window's."""
    for name in ("demo-0.jsonl", "demo-1.jsonl"):
        ends, errors, window_errors = [], [], []
        for t, prefix, left in checkpoints(recorded(name)):
            record = fold(prefix)
            eta = pace_eta(record, pace(record, t))
            assert eta is not None, (name, t)
            old = shard_eta(record, State.RUNNING, window_rates(record, t))
            ends.append((t, t + eta))
            errors.append(abs(eta - left) / left)
            window_errors.append(abs(old - left) / left if old is not None else 10.0)
        swings = [abs(e1 - e0) / (e0 - t0) for (t0, e0), (_, e1) in zip(ends, ends[1:])]
        assert max(swings) < 0.5, (name, [round(x, 2) for x in swings])
        assert sum(errors) < sum(window_errors), (name, sum(errors), sum(window_errors))


LONG = "long-sorted.jsonl"
DEMOS = ("demo-cost-a-0.jsonl", "demo-cost-a-1.jsonl", "demo-cost-b-0.jsonl", "demo-cost-b-1.jsonl")


def extraction(events: list[protocol.Record]) -> tuple[float, float]:
    """(first batch began, last row written) of the record's last attempt."""
    done = next(e for e in reversed(events) if isinstance(e, protocol.Done))
    began = next(e.batches_from for e in events if isinstance(e, protocol.Progress) and e.batches_from)
    written = next(e.t for e in events if isinstance(e, protocol.Progress) and e.tokens == done.tokens)
    return began, written


def replayed(name: str, start_fraction: float):
    """(fraction of the run, seconds left, ETA, the pace's ETA it replaced, allowed error) at every
    1% of the run from `start_fraction` on and at every progress event in it."""
    events = recorded(name)
    start, end = extraction(events)
    first = start + (end - start) * start_fraction
    grid = {start + (end - start) * i / 100 for i in range(round(start_fraction * 100), 100)}
    grid |= {e.t for e in events if isinstance(e, protocol.Progress) and first <= e.t < end}
    for t in sorted(grid):
        record = fold([e for e in events if e.t <= t])
        p = pace(record, t)
        assert p is not None and p.cost is not None, (name, t - start)
        left = end - t
        allowed = max(0.2 * left, max(iv[1] for iv in batches(record)))   # 20%, or one batch
        yield ((t - start) / (end - start), left, pace_eta(record, p),
               pace_eta(record, dataclasses.replace(p, cost=None)), allowed)


def test_the_eta_is_within_20_percent_from_the_first_tenth_of_the_long_sorted_run():
    """The length-sorted long run (rows of 3,709 down to 12 tokens; the per-token cost falls 2.5x):
    within 20% (or one batch) of the time really left at every moment from 10% of the run on.
    The pace it replaced was 60-100% long all along (docs/benchmarks.md)."""
    misses = [(round(f, 2), round(left, 1), round(eta, 1)) for f, left, eta, _, ok in replayed(LONG, 0.1)
              if abs(eta - left) > ok]
    assert not misses, ("(fraction, left, ETA)", misses)


@pytest.mark.parametrize("name", DEMOS)
def test_the_demo_eta_is_nearer_than_the_pace_and_within_20_percent_from_45_percent(name):
    """The demo on the busy development machine, recorded by the worker before it timed batches
    from their writes and measured attention's weight (the FLOP model's weight, 2 s ticks): its first rows (590-300 tokens) ran 1.6-2.2x
    slower per token than the rest, far steeper than the FLOP model (1.3x) — memory contention
    from the other work on the 2 cores hits the attention of long rows hardest (on the quiet
    machine, load 1.5, the per-token cost was flat). Until the fit has seen shorter rows the ETA
    runs long: within 20% from 45% of the run on, not 10% (the pace it replaced: from 75-94%);
    from 10% on, nearer the truth than the pace, in total."""
    rows = list(replayed(name, 0.1))
    misses = [(round(f, 2), round(left, 1), round(eta, 1)) for f, left, eta, _, ok in rows
              if f >= 0.45 and abs(eta - left) > ok]
    assert not misses, ("(fraction, left, ETA)", misses)
    ours = sum(abs(eta - left) / left for _, left, eta, _, _ in rows)
    theirs = sum(abs(old - left) / left for _, left, _, old, _ in rows)
    assert ours < 0.7 * theirs, (ours, theirs)


TIMED = tuple(f"demo-timed-{run}-{shard}.jsonl" for run in "abc" for shard in "01")


@pytest.mark.parametrize("name", TIMED)
def test_the_demo_eta_is_within_20_percent_from_the_first_tenth(name):
    """Issue 25's figure: the demo, quiet or beside other work, within 20% (or one batch) of the time
    really left at every moment from 10% of its run on. What made it: each batch timed from its
    write, not a 2 s tick (at a tenth of a 40 s run there are three batches), and the shape of the
    cost measured on the host (the FLOP model said a long row's attention costs 0.87e-3 per token
    of length; the CPU ran it at 1.1-2.9e-3)."""
    misses = [(round(f, 2), round(left, 1), round(eta, 1)) for f, left, eta, _, ok in replayed(name, 0.1)
              if abs(eta - left) > ok]
    assert not misses, ("(fraction, left, ETA)", misses)


@pytest.mark.parametrize("name", TIMED)
def test_batches_are_timed_from_the_writes_they_report(name):
    """The intervals the fit sees end where the worker counted the rows (`counted_t`, read here from
    the raw lines), not at the ticks that reported them; the first begins at `batches_from`."""
    raw = [e for e in protocol.iter_jsonl(os.path.join(RUNS, name)) if e["event"] == "progress"]
    moves = [b["counted_t"] for a, b in zip(raw, raw[1:]) if b["tokens"] != a["tokens"]]
    if raw[0]["tokens"]:
        moves.insert(0, raw[0]["counted_t"])
    intervals = batches(fold(recorded(name)))
    assert [iv[0] for iv in intervals] == pytest.approx(moves)
    assert any(e["counted_t"] != e["t"] for e in raw if e.get("counted_t"))
    began = next(e["batches_from"] for e in raw if e.get("batches_from"))
    assert intervals[0][0] - intervals[0][1] == pytest.approx(began)
    weights = {e["attention_weight"] for e in raw if e.get("attention_weight")}
    assert len(weights) == 1 and weights != {0.000868056}        # measured, not the FLOP model's


def test_records_without_the_cost_fold_and_keep_the_pace_eta():
    """An older worker's record (no cost fields): no fitted cost, the ETA of its pace as before."""
    events = recorded("demo-0.jsonl")
    progress = [e for e in events if isinstance(e, protocol.Progress)]
    t = progress[len(progress) // 2].t
    record = fold([e for e in events if e.t <= t])
    assert record.total_rows is None and record.attention_weight is None and record.sq_tokens == 0
    p = pace(record, t)
    assert p.cost is None and fit_cost(record, t) is None
    assert pace_eta(record, p) == p.per_unit * (record.total_tokens - record.tokens)


def test_nnls_recovers_a_cost_and_leans_on_the_prior_where_the_rows_cannot_tell():
    truth = (0.001, 0.0005, 2e-6)
    spread = [(10, 1000, 1e5), (20, 1000, 5e4), (40, 1000, 2.5e4), (80, 1000, 1.25e4)]
    ys = [sum(a * b for a, b in zip(x, truth)) for x in spread]
    assert all(abs(a - b) <= 1e-9 for a, b in zip(nnls_toward(spread, ys, (0, 0.001, 0), 0.0), truth))
    alike = [(10, 1000, 1e5)] * 4                           # one length only: the prior's shape holds
    ys = [sum(a * b for a, b in zip(x, truth)) for x in alike]
    prior = (0.0, 0.0007, 2e-6 * 0.7 / 0.5)
    theta = nnls_toward(alike, ys, prior, 0.05)
    assert min(theta) >= 0
    assert abs(sum(a * b for a, b in zip(alike[0], theta)) - ys[0]) <= 0.02 * ys[0]   # fits the time


def test_a_steady_pace_gives_the_eta_that_made_it():
    @given(st.floats(1e-5, 1e-2), st.lists(st.integers(1, 4096), min_size=2, max_size=40),
           st.integers(0, 100_000))
    def check(per_token, batches, left):
        t, tokens, events = 100.0, 0, [protocol.Launch(t=0.0, launch=1), protocol.Loaded(t=1.0, launch=1)]
        total = sum(batches) + left
        for k in batches:
            t += per_token * k
            tokens += k
            events.append(protocol.Progress(t=t, launch=1, done=tokens, total=total, tokens=tokens,
                                            total_tokens=total))
        record = fold(events)
        p = pace(record, t)
        want = per_token * left
        assert abs(pace_eta(record, p) - want) <= 1e-6 + 1e-6 * want
    check()


def test_progress_age_is_late_against_the_shards_own_pace():
    events = recorded("demo-0.jsonl")
    progress = [e for e in events if isinstance(e, protocol.Progress)]
    mid = progress[len(progress) // 2]
    record = fold([e for e in events if e.t <= mid.t])
    p = progress_age(record, mid.t + 1.0)
    assert p is not None and p.usual_s is not None and not p.late
    usual = p.usual_s
    late = progress_age(record, mid.t + max(3 * usual, 10) + 1)
    assert late.late and late.age_s > 3 * usual
    assert progress_age(fold(events), events[-1].t + 100) is None          # ended: no age


def test_the_live_record_refits_now_and_then_and_holds_the_same_bound():
    """The supervisor applies events to one record as they come; the fit is kept on the attempt
    and redone once per REFIT_S of progress (a 600-point fit is ~3 ms: 512 shards at every event
    would cost a core), with the time since the last progress always current."""
    events = recorded(LONG)
    start, end = extraction(events)
    record = ShardRecord()
    checked = 0
    for e in events:
        record.apply(e)
        if isinstance(e, protocol.Progress) and start + (end - start) / 10 <= e.t < end:
            p = pace(record, e.t + 1.0)
            left = end - e.t - 1.0
            allowed = max(0.2 * left, max(iv[1] for iv in batches(record)))
            assert abs(pace_eta(record, p) - left) <= allowed, (e.t - start, left, pace_eta(record, p))
            assert p.cost.since_s >= 1.0
            checked += 1
    assert checked > 50


def test_the_run_eta_of_a_host_sharing_its_rows_is_the_pools_not_its_slowest_shards(tmp_path, dense_model):
    """Three real workers of one host sharing their rows, one slowed: a third of the way from all
    three running to their last row written, the run's ETA is the pool's (its work left over its
    summed rate), nearer the time the run really took than the slowest shard's own ETA (which is
    when a run of fixed shards would end)."""
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 1800, vocab_size=500, mean_tokens=30, seed=9)
    assert run_pool(tmp_path, dense_model, data, 3, {"FLEET_INJECT_SLOW_GPU": "2:0.15"}) == {0: 0, 1: 0, 2: 0}
    records = {}
    for k in range(3):                   # as hostctl launches a worker: its launch record first
        events = [protocol.parse_event(e) for e in shard_events(tmp_path, k)]
        for e in events:
            e.launch = 1
        records[k] = [protocol.Launch(t=events[0].t, launch=1), *events]
    start = max(e.t for evs in records.values() for e in evs if e.KIND == "loaded")   # all three running
    end = max(e.t for evs in records.values() for e in evs if e.KIND == "progress")   # the last row written
    t = start + (end - start) / 3
    policy = Policy(max_restarts=3, stall_timeout=120)
    views = []
    for k in range(3):
        r = fold([e for e in records[k] if e.t <= t])
        views.append(ShardView(k, "local", k, r, judge(r, True, t, policy), True, None, policy.max_restarts))
    snap = build_snapshot("pool", views, {"local": Host("local", "local", reachable=True, replayed=True)},
                          now=t, expected=ExpectedSpec())
    slowest = max(s.eta_s for s in snap.shards)
    assert all(s.lease is not None for s in snap.shards)
    assert snap.totals.eta_s is not None and snap.totals.eta_s < slowest
    assert abs(snap.totals.eta_s - (end - t)) < abs(slowest - (end - t))


def slowed(events: list[protocol.Record], factor: float) -> list[protocol.Record]:
    """A recorded run played `factor` times slower: every time in it stretched (batches of ~4 s
    become batches of ~40 s, longer than the rate's window, as on a busy CPU host)."""
    out = []
    for e in events:
        d = e.to_dict()
        for key in ("t", "counted_t", "batches_from"):
            if d.get(key) is not None:
                d[key] = d[key] * factor
        out.append(protocol.parse_event(d))
    return out


@pytest.mark.parametrize("name", ["demo-0.jsonl", "demo-cost-b-1.jsonl", LONG])
def test_a_shard_whose_batches_outlast_the_window_never_reads_zero_between_them(name):
    """A real run's record ten times slower (batches of 20-100 s against the 30 s window): from its
    second batch to its last, every second, the shard's token rate is within a factor 4 of its pace
    over the whole run, where the 30 s window's read 0 between batches (issue 39: '0 tok/s' at 23%)."""
    events = slowed(recorded(name), 10.0)
    ends = batch_ends(fold(events).attempt.history)
    (t0, _, k0, _), (t1, _, k1, _) = ends[1], ends[-1]
    overall = (k1 - k0) / (t1 - t0)
    seen, window_seen = [], []
    for t in (t0 + i for i in range(int(t1 - t0))):
        record = fold([e for e in events if e.t <= t])
        seen.append(rates(record, State.RUNNING, t).tokens_per_s)
        window_seen.append(window_rates(record, t).tokens_per_s)
    assert overall / 4 < min(seen) and max(seen) < overall * 4, (name, min(seen), max(seen), overall)
    assert min(window_seen) == 0.0                       # what the window said between the same batches


def moved_points(history, column: int) -> list[tuple]:
    """What figures.pace read off the whole history before the record kept it as it folded: the
    points where `column` changed, from the first above 0 on."""
    moved = [p for i, p in enumerate(history) if i == 0 or p[column] != history[i - 1][column]]
    return [p for p in moved if p[column] > 0]


def test_the_figures_kept_as_the_record_folds_are_those_of_its_whole_history():
    """Attempt.ends and Attempt.moved (kept point by point, so the judge and each picture need not
    walk 600 points a shard) equal batch_ends and the pace's points computed over the history
    afterwards, over random progress (counters that stall, move one at a time or together) and a
    relaunch, and over every recorded run."""
    @given(st.lists(st.tuples(st.floats(0.01, 30), st.integers(0, 3), st.integers(0, 500), st.integers(0, 9000),
                              st.booleans()), min_size=1, max_size=120), st.integers(0, 119))
    def check(steps, relaunch_at):
        t, done, tokens, nbytes = 10.0, 0, 0, 0
        events = [protocol.Launch(t=0.0, launch=1), protocol.Loaded(t=1.0, launch=1)]
        for i, (dt, d_done, d_tokens, d_bytes, counted_early) in enumerate(steps):
            if i == relaunch_at:
                events.append(protocol.Launch(t=t, launch=2))
            t += dt
            done, tokens, nbytes = done + d_done, tokens + d_tokens, nbytes + d_bytes
            events.append(protocol.Progress(t=t, launch=2 if i >= relaunch_at else 1, done=done, total=10_000,
                                            tokens=tokens, bytes=nbytes, counted_t=t - dt / 2 if counted_early else None))
        a = fold(events).attempt
        assert list(a.ends) == batch_ends(a.history)
        for column in (1, 2):
            assert list(a.moved[column]) == moved_points(a.history, column)
    check()
    for name in sorted(os.listdir(RUNS)):
        a = fold(recorded(name)).attempt
        if a is not None and len(a.history) < 600:
            assert list(a.ends) == batch_ends(a.history), name
            assert [list(a.moved[c]) for c in (1, 2)] == [moved_points(a.history, c) for c in (1, 2)], name
