"""The fold (fleet.record), the judge (fleet.judge) and the snapshot maths (fleet.snapshot): pure
code, exercised with typed protocol events, plus property tests of the judge's invariants over
random event sequences. (What the real runner and agent write is tested in test_records.py.)"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.config import ExpectedSpec
from fleet.judge import Action, LaunchFailure, Policy, backoff_delay, judge, rates
from fleet.record import ShardRecord, fold
from fleet.snapshot import ShardView, build_snapshot, status_exit_code
from fleet.hosts import Host
from fleet.state import SETTLED, State
from worker import protocol as p
from worker.agent import thin_progress

POLICY = Policy(max_restarts=3, backoff_base=2, backoff_max=60, stall_timeout=120)


def launch(t, n=1, by="manual"):
    return p.Launch(t=t, launch=n, by=by, gpu=0)


def verdict(events, now, alive=None, policy=POLICY, **kw):
    return judge(fold(events, policy.needs_done_sentinel), alive, now, policy, **kw)


def test_happy_path_states():
    evs = [launch(1)]
    assert verdict([], 0).state == State.PENDING and verdict([], 0).action == Action.LAUNCH
    assert verdict(evs, 1, True).state == State.STARTING
    evs += [p.Started(t=2, launch=1, pid=42, total=10), p.Loading(t=2, launch=1)]
    assert verdict(evs, 2, True).state == State.LOADING
    evs += [p.Loaded(t=5, launch=1)]
    v = verdict(evs, 5, True)                      # loaded, no sample finished yet: still warming up
    assert (v.state, v.reason) == (State.LOADING, "model loaded; reading its rows and running the first batch")
    assert verdict(evs + [p.Progress(t=6, launch=1, done=0, total=10)], 6, True).state == State.LOADING
    evs += [p.Progress(t=7, launch=1, done=4, total=10, tokens=400, bytes=1000)]
    assert verdict(evs, 7, True).state == State.RUNNING
    r = fold(evs)
    assert (r.done, r.tokens, r.total) == (4, 400, 10)
    evs += [p.Done(t=9, launch=1, done=10, total=10, tokens=1000, bytes=2500), p.Exited(t=9.1, launch=1, code=0)]
    v = verdict(evs, 10, False)
    assert v.state == State.DONE and v.action == Action.NONE


def test_failure_reasons_in_order_of_precedence():
    base = [launch(1), p.Started(t=2, launch=1)]
    assert verdict(base + [p.Exited(t=3, launch=1, code=-9)], 3).reason == "killed by signal 9; restart in 2s"
    failed = base + [p.Failed(t=2.5, launch=1, reason="disk full at /o"), p.Exited(t=3, launch=1, code=1)]
    assert verdict(failed, 3).reason == "disk full at /o; restart in 2s"
    vanished = base + [p.Exited(t=3, launch=1, vanished=True)]
    assert verdict(vanished, 3).reason.startswith("process vanished without an exit status")
    # Dead before the agent recorded it: FAILED, nothing due until the record says so.
    v = verdict(base, 3, alive=False)
    assert v.state == State.FAILED and v.action == Action.NONE


def test_a_stop_is_stopped_even_when_it_had_to_sigkill_and_is_never_restarted():
    evs = [launch(1), p.Loaded(t=2, launch=1), p.StopRequested(t=5, launch=1, why="user")]
    assert verdict(evs, 5, True).reason == "stopping; SIGKILL in 10s"
    assert verdict(evs, 16, True).reason == "stopping; SIGKILL sent"
    for end in (p.Exited(t=6, launch=1, code=-9),                   # the runner saw the SIGKILL
                p.Exited(t=6, launch=1, vanished=True),             # the runner was killed too
                p.Exited(t=6, launch=1, code=-15, stopped=True)):
        v = verdict(evs + [end], 10_000, False)
        assert (v.state, v.action) == (State.STOPPED, Action.NONE)
    # A restart's stop is not the user's: the failure it restarts from stays the reason.
    evs = [launch(1), p.Loaded(t=2, launch=1), p.StopRequested(t=5, launch=1, why="restart", reason="no progress for 130s"),
           p.Exited(t=6, launch=1, code=-15)]
    assert verdict(evs, 6).reason == "no progress for 130s; restart in 2s"


def test_work_done_before_a_stop_landed_is_done():
    evs = [launch(1), p.Done(t=4, launch=1, done=5, total=5), p.StopRequested(t=5, launch=1),
           p.Exited(t=5.1, launch=1, code=0)]
    assert verdict(evs, 6, False).state == State.DONE


def test_custom_job_sentinels_order_and_need():
    job = Policy(needs_done_sentinel=True, custom_job=True, stall_timeout=None)
    evs = [launch(1), p.Started(t=1.1, launch=1, pid=9)]
    assert verdict(evs, 2, True, job).state == State.RUNNING            # a [job] runs once started
    no_line = evs + [p.Exited(t=3, launch=1, code=0)]
    assert verdict(no_line, 3, False, job).reason.startswith("exited 0 without the done sentinel")
    done = evs + [p.Sentinel(t=2.5, launch=1, match="done", line="extract-only mode"), p.Exited(t=3, launch=1, code=0)]
    assert verdict(done, 3, False, job).state == State.DONE
    fail = evs + [p.Sentinel(t=2, launch=1, match="fail", line="ERROR: CUDA error")]
    v = verdict(fail, 2, True, job)                                    # still running: failed all the same
    assert v.state == State.BACKOFF and "fail sentinel: ERROR: CUDA error" in v.reason
    assert verdict(fail, 4.1, True, job).action == Action.RESTART
    # A fail line of an earlier launch never touches the newest one.
    relaunched = fail + [p.Exited(t=2.5, launch=1, code=1), launch(5, n=2, by="auto"),
                         p.Sentinel(t=2, launch=1, match="fail", line="ERROR replayed late")]
    assert verdict(relaunched, 6, True, job).state == State.STARTING


def test_a_failure_the_worker_calls_not_retryable_is_fatal_at_once_alive_or_not():
    evs = [launch(0), p.Loaded(t=1, launch=1), p.Failed(t=2, launch=1, reason="skipped 9 of 10 rows", fatal=True)]
    why = "skipped 9 of 10 rows (not retried by itself: its next launch would fail the same way)"
    v = verdict(evs, 1000, True)                 # no live process in FATAL: what is left is stopped first
    assert (v.state, v.action) == (State.STOPPING, Action.STOP) and v.reason.startswith(why)
    v = verdict(evs + [p.Exited(t=3, launch=1, code=1)], 1000, False)
    assert (v.state, v.action) == (State.FATAL, Action.NONE)
    assert v.reason == why


def test_a_repaired_done_shard_is_pending_and_launched_again():
    done = [launch(0), p.Done(t=2, launch=1, done=5, total=5), p.Exited(t=3, launch=1, code=0)]
    v = verdict(done + [p.Reopened(t=9, samples=2, reason="dropped by fleet verify --repair")], 10, False)
    assert (v.state, v.action) == (State.PENDING, Action.LAUNCH)
    assert v.reason == "2 sample(s) to redo: dropped by fleet verify --repair"
    relaunched = done + [p.Reopened(t=9, samples=2, reason="r"), launch(11, n=2)]
    assert verdict(relaunched, 12, True).state == State.STARTING


def test_restart_policy_backs_off_then_gives_up_and_a_manual_launch_resets():
    assert [backoff_delay(a, 2, 60) for a in range(7)] == [2, 4, 8, 16, 32, 60, 60]
    evs, t = [launch(0)], 0.0
    for attempt in range(3):
        t += 1
        evs.append(p.Exited(t=t, launch=attempt + 1, code=1))
        v = verdict(evs, t, False)
        delay = backoff_delay(attempt, 2, 60)
        assert v.state == State.BACKOFF and v.due_t == t + delay and v.action == Action.NONE
        assert verdict(evs, t + delay, False).action == Action.RESTART
        t += delay
        evs.append(launch(t, n=attempt + 2, by="auto"))
    evs.append(p.Exited(t=t + 1, launch=4, code=1))
    v = verdict(evs, t + 1000, False)
    assert v.state == State.FATAL and v.action == Action.NONE and v.reason.startswith("gave up after 3")
    evs.append(launch(t + 2000, n=5, by="manual"))
    assert fold(evs).auto_attempts == 0 and fold(evs).launches == 5


def test_a_failed_launch_counts_as_an_attempt_and_backs_off():
    evs = [launch(0), p.Exited(t=1, launch=1, code=1)]
    fails = (LaunchFailure(3.0, "auto", "python not found"),)
    v = verdict(evs, 3.0, False, launch_failures=fails)
    assert v.state == State.BACKOFF and v.attempts == 1 and v.action == Action.NONE
    assert v.reason == "launch failed: python not found; restart in 4s"
    assert verdict(evs, 7.0, False, launch_failures=fails).action == Action.RESTART
    many = tuple(LaunchFailure(3.0 + i, "auto", "python not found") for i in range(3))
    assert verdict(evs, 100, False, launch_failures=many).state == State.FATAL


def test_stall_is_detected_on_host_time_shown_then_restarted_and_clears():
    evs = [launch(1), p.Loaded(t=2, launch=1), p.Progress(t=10, launch=1, done=1, total=5)]
    assert verdict(evs, 100, True).state == State.RUNNING
    v = verdict(evs, 131, True)
    assert v.state == State.STALLED and v.action == Action.NONE and v.due_t == 10 + 120 + 2
    assert verdict(evs, 132, True).action == Action.RESTART
    off = Policy(restart_stalled=False)
    assert verdict(evs, 1000, True, off).state == State.STALLED and verdict(evs, 1000, True, off).action == Action.NONE
    evs.append(p.Progress(t=132, launch=1, done=2, total=5))
    assert verdict(evs, 133, True).state == State.RUNNING


def test_a_silent_running_shard_is_late_before_it_is_stalled():
    """Progress every 2 s, then silence: RUNNING up to three usual intervals (and at least
    LATE_MIN_S), LATE after (its reason says how long and when it will be STALLED), STALLED at
    stall_timeout; progress again is RUNNING. A replay thinned by the agent judges the same."""
    evs = [launch(1), p.Loaded(t=1, launch=1)] + [p.Progress(t=t, launch=1, done=t, total=500)
                                                   for t in range(2, 300, 2)]
    last = 298
    assert verdict(evs, last + 9, True).state == State.RUNNING
    v = verdict(evs, last + 11, True)
    assert (v.state, v.action) == (State.LATE, Action.NONE)
    assert v.reason == "silent 11s (usually 2s); STALLED at 120s"
    thinned = thin_progress([p.parse_event(e.to_dict()) for e in evs])
    assert len(thinned) < len(evs) and judge(fold(thinned), True, last + 11, POLICY) == v
    assert verdict(evs, last + 121, True).state == State.STALLED
    assert verdict(evs + [p.Progress(t=last + 30, launch=1, done=300, total=500)], last + 31, True).state \
        == State.RUNNING
    slow = [launch(1), p.Loaded(t=1, launch=1)] + [p.Progress(t=t, launch=1, done=t, total=500)
                                                   for t in range(10, 200, 10)]
    assert verdict(slow, 190 + 25, True).state == State.RUNNING          # 2.5 of its usual 10 s
    assert verdict(slow, 190 + 31, True).state == State.LATE


def test_rates_are_measured_over_batches_and_fall_when_the_next_is_late():
    evs = [launch(0), p.Loaded(t=1, launch=1)]
    assert rates(fold(evs), State.RUNNING, 1) is None                  # not measured, never zero
    for t in range(2, 12, 2):
        evs.append(p.Progress(t=t, launch=1, done=t * 5, tokens=t * 500, bytes=t * 1000, total=1000))
    r = rates(fold(evs), State.RUNNING, 10)
    assert (round(r.samples_per_s, 6), round(r.tokens_per_s, 6), round(r.bytes_per_s, 6)) == (5.0, 500.0, 1000.0)
    assert rates(fold(evs), State.RUNNING, 12).samples_per_s == 5.0      # the next batch is not late yet
    assert rates(fold(evs), State.RUNNING, 25).samples_per_s == 5.0 * 2 / 15   # late: usual 2 s over 15 s
    assert rates(fold(evs), State.RUNNING, 35).samples_per_s == 5.0 * 2 / 25
    assert rates(fold(evs), State.RUNNING, 40).samples_per_s == 0.0      # a window with no batch
    assert rates(fold(evs), State.LOADING, 10) is None
    evs.append(launch(12, n=2, by="auto"))                               # a restart starts from no rate
    assert rates(fold(evs), State.RUNNING, 13) is None


def view(k, host, events, now, alive=True, policy=POLICY, down=None):
    """The shard as the store gives it to the snapshot (`down`: why its host cannot be read)."""
    r = fold(events)
    return ShardView(k, host, k, r, judge(r, alive, now, policy, host_down=down), alive, None, policy.max_restarts)


def test_snapshot_totals_expected_alert_unknown_hosts_and_exit_codes():
    hosts = {"a": Host("a", "1.1.1.1", reachable=True, replayed=True),
             "b": Host("b", "2.2.2.2", reachable=True, replayed=True)}
    running = [launch(0), p.Loaded(t=1, launch=1)] + [
        p.Progress(t=t, launch=1, done=t, tokens=t * 100, bytes=t * 10, total=100) for t in range(2, 12, 2)]
    views = [view(i, h, running, 10) for i, h in enumerate(("a", "a", "b"))]
    exp = ExpectedSpec(samples_per_s_per_gpu=2.0, alert_ratio=0.8)
    t = build_snapshot("r", views, hosts, now=10, expected=exp).totals
    assert t.samples_per_s == 3.0 and t.expected_per_s == 6.0 and t.ratio == 0.5
    assert t.alert and t.alert_level == "low" and t.by_state == {"RUNNING": 3}
    assert t.eta_s == round((300 - 30) / 3.0)
    snap = build_snapshot("r", views, hosts, now=10, expected=exp)
    assert snap.schema_ == "fleet.status/3" and status_exit_code(snap) == 0
    assert '"schema": "fleet.status/3"' in snap.to_json()
    # An unreachable host: its shards are UNKNOWN, unmeasured, and not expected to produce.
    hosts["b"].reachable, hosts["b"].error = False, "connection refused"
    views[2] = view(2, "b", running, 10, down=hosts["b"].down_reason)        # judged with its host's word
    snap = build_snapshot("r", views, hosts, now=10, expected=exp)
    row = snap.shards[2]
    assert row.state == State.UNKNOWN and row.samples_per_s is None and "connection refused" in row.reason
    assert snap.hosts[1].gpus is None                                   # not measured, not zero
    assert snap.totals.expected_per_s == 4.0 and snap.totals.ratio == 0.5
    assert status_exit_code(snap) == 3
    hosts["b"].reachable = True
    failed = view(0, "a", running + [p.Exited(t=12, launch=1, code=1)], 12, alive=False)
    snap = build_snapshot("r", [failed] + views[1:], hosts, now=12, expected=exp)
    assert snap.shards[0].faulty and status_exit_code(snap) == 1
    stopped = view(0, "a", running + [p.StopRequested(t=12, launch=1), p.Exited(t=12, launch=1, code=-15)], 12, False)
    done = view(1, "a", running + [p.Done(t=12, launch=1, done=100, total=100), p.Exited(t=12, launch=1, code=0)], 12, False)
    snap = build_snapshot("r", [stopped, done], hosts, now=13, expected=exp)
    assert [s.state for s in snap.shards] == [State.STOPPED, State.DONE]
    assert status_exit_code(snap) == 0 and snap.totals.settled and snap.totals.expected_per_s is None


def test_on_a_cpu_with_no_figure_given_the_workers_timing_at_load_is_expected():
    """Issue 55: the demo's fixed 1,800 tokens/s was another CPU's; with no figure in fleet.toml
    the expected rate is the mean of what the workers timed at load, x the GPUs (slots) expected."""
    hosts = {"a": Host("a", "1.1.1.1", reachable=True, replayed=True)}
    running = [launch(0), p.Loaded(t=1, launch=1, cpu_tokens_per_s=150.0)] + [
        p.Progress(t=t, launch=1, done=t, tokens=t * 100, total=100, total_tokens=10_000) for t in range(2, 12, 2)]
    slower = [launch(0), p.Loaded(t=1, launch=1, cpu_tokens_per_s=50.0)] + running[2:]
    views = [view(0, "a", running, 10), view(1, "a", slower, 10)]
    t = build_snapshot("r", views, hosts, now=10, expected=ExpectedSpec()).totals
    assert t.expected_tokens_per_s == 200.0 and t.tokens_per_s == 200.0 and t.ratio == 1.0
    assert t.alert_level == "ok"
    t = build_snapshot("r", views, hosts, now=10, expected=ExpectedSpec(tokens_per_s_per_gpu=400)).totals
    assert t.expected_tokens_per_s == 800.0 and t.ratio == 0.25      # a figure given wins


def test_run_totals_count_the_plans_rows_once_wherever_they_moved():
    """Issue 55: while rows moved the run read 191/450 on a 300-row dataset. The run's total is
    its plan's rows; done never passes it."""
    hosts = {"a": Host("a", "1.1.1.1", reachable=True, replayed=True)}
    def shard(k, total, done):
        return [launch(0), p.Started(t=1, launch=1, start=100 * k, stop=100 * (k + 1), total=100, num_rows=300),
                p.Loaded(t=1, launch=1), p.Progress(t=2, launch=1, done=0, total=total),
                p.Progress(t=4, launch=1, done=done, total=total)]
    views = [view(0, "a", shard(0, 100, 100), 5), view(1, "a", shard(1, 250, 120), 5),   # took 150
             view(2, "a", shard(2, 100, 80), 5)]                                         # not yet told
    t = build_snapshot("r", views, hosts, now=5, expected=ExpectedSpec()).totals
    assert (t.done, t.total) == (300, 300)


# --- invariants over random histories ---------------------------------------------------------

WORKER = st.sampled_from(["started", "loading", "loaded", "progress", "progress", "done", "failed",
                          "fatal", "fail_line", "done_line"])
STEP = st.one_of(
    st.tuples(st.just("worker"), WORKER),
    st.tuples(st.just("exit"), st.sampled_from([0, 0, 1, -9])),
    st.tuples(st.just("vanish"), st.just(0)),
    st.tuples(st.just("user_stop"), st.booleans()),
    st.tuples(st.just("manual"), st.just(0)),
    st.tuples(st.just("time"), st.floats(0.1, 90)),
)


class World:
    """A shard's host, simulated: the process lives between a launch and its end; the record is
    what runner, worker and agent would append; the supervisor carries out the judge's actions."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.t = 1000.0
        self.events: list[p.Record] = []
        self.live = ShardRecord(needs_done_sentinel=policy.needs_done_sentinel)
        self.n = 0
        self.running = False          # the process (or its runner) holds the lock
        self.done = 0
        self.checkpoints: list[tuple] = []

    def add(self, ev: p.Record) -> None:
        self.events.append(ev)
        self.live.apply(ev)

    def launch(self, by: str) -> None:
        self.n += 1
        self.running = True
        self.add(p.Launch(t=self.t, launch=self.n, by=by, gpu=0))

    def end(self, **kw) -> None:
        self.add(p.Exited(t=self.t, launch=self.n, **kw))
        self.running = False

    def step(self, kind, arg) -> None:
        n, t = self.n, self.t
        if kind == "time":
            self.t += arg
        elif kind == "manual":
            if not self.running:
                self.launch("manual")
        elif not self.running:
            return
        elif kind == "worker":
            if arg == "progress":
                self.done += 1
                self.add(p.Progress(t=t, launch=n, done=self.done, total=100, tokens=self.done * 7))
            elif arg == "done":
                self.add(p.Done(t=t, launch=n, done=self.done, total=100))
            elif arg in ("failed", "fatal"):
                self.add(p.Failed(t=t, launch=n, reason="boom", fatal=arg == "fatal"))
            elif arg in ("fail_line", "done_line"):
                self.add(p.Sentinel(t=t, launch=n, match=arg[:4], line="a line"))
            else:
                cls = {"started": p.Started, "loading": p.Loading, "loaded": p.Loaded}[arg]
                self.add(cls(t=t, launch=n))
        elif kind == "exit":
            self.end(code=arg)
        elif kind == "vanish":
            self.end(vanished=True)
        elif kind == "user_stop":
            self.add(p.StopRequested(t=t, launch=n, why="user"))
            self.end(code=-9) if arg else self.end(vanished=True)

    def supervise(self) -> None:
        """What the supervisor and the host's one door do with the verdict (fleet/actions.py)."""
        v = judge(self.live, self.running, self.t, self.policy)
        if v.action == Action.RESTART:
            assert v.state not in (State.DONE, State.STOPPED)
            assert v.due_t is not None and self.t >= v.due_t
            if self.running:                  # the intent first, then the signal, then the launch
                self.add(p.StopRequested(t=self.t, launch=self.n, why="restart", reason=v.reason,
                                         then="launch", by=v.by))
                self.end(code=-15)
            self.launch(v.by)
        elif v.action == Action.STOP:         # giving up with the process alive: kill what is left
            assert self.running and v.state == State.STOPPING
            self.add(p.StopRequested(t=self.t, launch=self.n, why="fatal", reason=v.reason))
            self.end(code=-15)
        elif v.action == Action.LAUNCH:
            assert v.state == State.PENDING
            self.launch("manual")
        assert self.live.auto_attempts <= self.policy.max_restarts
        after = judge(self.live, self.running, self.t, self.policy)
        assert not (self.running and after.state in (State.DONE, State.FATAL, State.STOPPED)), after
        self.checkpoints.append((len(self.events), self.t, self.running, after))


def assert_within_restart_budget(events: list, max_restarts: int) -> None:
    """Auto launches between two manual ones never exceed the budget."""
    run = 0
    for ev in events:
        if isinstance(ev, p.Launch):
            run = run + 1 if ev.by == "auto" else 0
            assert run <= max_restarts


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(STEP, max_size=60), max_restarts=st.integers(0, 4),
       needs_done=st.booleans(), restart_stalled=st.booleans())
def test_judge_invariants_over_random_histories(steps, max_restarts, needs_done, restart_stalled):
    policy = Policy(max_restarts=max_restarts, backoff_base=1, backoff_max=8, stall_timeout=30,
                    restart_stalled=restart_stalled, needs_done_sentinel=needs_done)
    w = World(policy)
    for kind, arg in steps:
        w.step(kind, arg)
        w.supervise()
    assert_within_restart_budget(w.events, max_restarts)
    # Every prefix replayed from scratch (and through the agent's replay thinning) is judged as the
    # live stream judged it at that point.
    for length, t, alive, live in w.checkpoints:    # `live`: the verdict the live record gave then
        prefix = w.events[:length]
        replayed = judge(fold(prefix, needs_done), alive, t, policy)
        assert live == replayed
        thinned = thin_progress([p.parse_event(e.to_dict()) for e in prefix])   # as read from the file
        assert judge(fold(thinned, needs_done), alive, t, policy) == live
    final = judge(w.live, w.running, w.t, policy)
    assert final == judge(fold(w.events, needs_done), w.running, w.t, policy)
    if final.state in SETTLED:
        w.t += 10_000                                     # nothing happens by itself afterwards
        assert judge(w.live, w.running, w.t, policy).action == Action.NONE


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(), st.text(max_size=5),
                                                                   st.floats(allow_nan=True))),
                          st.fixed_dictionaries({"event": st.sampled_from(sorted(p.EVENT_TYPES)),
                                                 "t": st.one_of(st.floats(0, 1e6), st.text(max_size=3)),
                                                 "launch": st.one_of(st.none(), st.integers(-2, 3), st.text(max_size=2))})),
                max_size=30))
def test_any_json_object_in_a_record_is_parsed_or_ignored_never_a_crash(dicts):
    record = ShardRecord()
    for d in dicts:
        ev = p.parse_event(d)
        if ev is not None:
            record.apply(ev)
    judge(record, None, 1e6, POLICY)
