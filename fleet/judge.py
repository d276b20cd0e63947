"""The one judge: a shard's folded record, its liveness and the host's clock in; its state, the
reason and the action due out. Pure: no I/O, no asyncio, no clock of its own.

Live supervision carries out the action (`fleet up`); `fleet status` shows the same verdict and
ignores the action. Nothing else decides a shard's state. Times are the host's clock throughout,
so skew between the supervisor and a host never matters.

Invariants (tested with hypothesis in tests/fleet/test_judge.py):
- a DONE or STOPPED shard is never relaunched automatically;
- automatic restarts since the last manual launch never exceed `max_restarts`; then FATAL;
- a restart is never due before `backoff_delay(attempts)` has passed since the failure;
- the verdict depends only on the record, liveness and time: replaying a record gives the verdict
  the live stream gave at that point.

Under an engine that queues tasks, "liveness" is what the engine says now of the newest launch's
task (queued with its reason, running on a node: `protocol.TaskState`), and how a task ended is in
the record (`task_end`). A task the engine ended by a signal is FAILED (no action) until the
engine's final word is recorded (time limit, preemption, node failure, someone's cancel), or
ENGINE_WORD_WAIT_S after its end at the latest; then it backs off and restarts as any failure does.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from dataclasses import dataclass
from enum import Enum

from worker import protocol

from .figures import progress_age
from .record import Attempt, Outcome, Phase, ShardRecord, awaiting_engine, outcome
from .state import MEASURED, State

RATE_WINDOW_S = 30.0
STALE_BATCHES = 4          # a rate is 0 once no batch ended for this many of its usual intervals
ENGINE_WORD_WAIT_S = 30.0  # a restart waits this long (at most) for the engine's account of an end
WARMING_UP = "model loaded; reading its rows and running the first batch"
RECORD_LOST = ("a process holds the shard's lock but its record has no launch (events.jsonl truncated "
               "or replaced?): not launched again; fleet down stops it")
STALL_SHOWN_S = 2.0       # a stalled shard is restarted no sooner than this after it is seen stalled:
                          # longer than the TUI's 1.5 s redraw, so STALLED is on screen at least once


class Action(str, Enum):
    NONE = "none"
    LAUNCH = "launch"            # never launched: start it
    RESTART = "restart"          # failed or stalled, backoff over: stop if alive, launch by=auto
    STOP = "stop"                # out of restarts with its process alive: kill what is left (FATAL after)


HANDOFF_S = 5.0           # a restart's launch is its actor's; with no actor left on the host, the
                          # supervisor launches once this long has passed since the old process ended
STOP_STUCK_S = 30.0       # a stop not finished this long after its SIGKILL, with no actor left: again


@dataclass(frozen=True)
class Policy:
    max_restarts: int = 3
    backoff_base: float = 2.0
    backoff_max: float = 60.0
    stall_timeout: float | None = 120.0   # None: no stall detection (a [job] with no progress)
    restart_stalled: bool = True
    needs_done_sentinel: bool = False
    custom_job: bool = False              # a [job]: RUNNING as soon as its process starts


@dataclass(frozen=True)
class LaunchFailure:
    """A launch that never reached the host's record (hostctl could not run): kept by the live
    supervisor, counted by the judge like a failed attempt. `t` is host time."""
    t: float
    by: str
    reason: str


@dataclass(frozen=True)
class Verdict:
    state: State
    reason: str | None = None
    action: Action = Action.NONE
    due_t: float | None = None            # host time a pending restart is due (STOPPING: the SIGKILL)
    attempts: int = 0                     # automatic attempts counted toward max_restarts
    by: str = "auto"                      # RESTART: the relaunch's `by` (manual: the user's restart)
    recorded: State | None = None         # UNKNOWN (its host cannot be read): the state its record last gave


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Capped exponential: base, 2 base, 4 base, ... never above cap."""
    return min(cap, base * (2 ** attempt))


def judge(record: ShardRecord, alive: bool | None, host_now: float, policy: Policy,
          launch_failures: tuple[LaunchFailure, ...] = (),
          task: protocol.TaskState | None = None, acting: bool | None = None,
          idle_s: float | None = None, host_down: str | None = None) -> Verdict:
    """`task`: what the engine says now of the newest launch's task (ignored if it is another's).
    `acting`: a stop or restart is being carried out on the host now (None: nothing acts there).
    `idle_s`: seconds since the last progress on monotonic clocks (the host agent's): stalls are
    judged on it when given, so a step of the host's wall clock neither stalls nor hides a shard.
    `host_down`: why its host cannot be read now: the shard is UNKNOWN (no action; the state its
    record last gave kept as `recorded`), the one rule every reader of a verdict follows."""
    v = _judged(record, alive, host_now, policy, launch_failures, task, acting, idle_s)
    if host_down is not None:
        return Verdict(State.UNKNOWN, host_down, attempts=v.attempts, recorded=v.state)
    return v


def _judged(record: ShardRecord, alive: bool | None, host_now: float, policy: Policy,
            launch_failures: tuple[LaunchFailure, ...], task: protocol.TaskState | None,
            acting: bool | None, idle_s: float | None) -> Verdict:
    a = record.attempt
    if task is not None and (a is None or task.launch != a.n):
        task = None
    failures = [f for f in launch_failures if a is None or f.t >= a.t]
    attempts = record.auto_attempts
    for f in failures:
        attempts = 0 if f.by == "manual" else attempts + 1
    if failures:
        return _failed(f"launch failed: {failures[-1].reason}", failures[-1].t, attempts, host_now, policy)
    if a is None:
        return _unlaunched(record, alive)
    if a.ended:
        return _ended(record, a, acting, host_now, policy, attempts)
    if a.queued and a.pid is None and alive is not False and (task is None or task.phase == "queued"):
        if a.stop is not None:
            return Verdict(State.QUEUED, "cancelling", attempts=attempts)
        why = task.reason if task is not None else (None if a.job else f"submitting to {a.launcher}")
        return Verdict(State.QUEUED, why, attempts=attempts)
    if alive is False:                     # dead, its end not yet in the record (the agent adds it)
        return Verdict(State.FAILED, "process vanished without an exit status", attempts=attempts)
    return _live(record, a, acting, host_now, policy, attempts, idle_s)


def _unlaunched(record: ShardRecord, alive: bool | None) -> Verdict:
    if record.unlaunched_stop is not None:
        return Verdict(State.STOPPED, "stopped before it started")
    if alive:                              # its record lost the launch (truncated): never launch again
        return Verdict(State.UNKNOWN, RECORD_LOST)
    return Verdict(State.PENDING, action=Action.LAUNCH)


def _ended(record: ShardRecord, a: Attempt, acting: bool | None, host_now: float, policy: Policy,
           attempts: int) -> Verdict:
    """The newest attempt has ended: DONE, STOPPED, a restart under way, or a failure's backoff."""
    end = a.end
    assert end is not None                 # (a.ended)
    kind, why = outcome(a, record.needs_done_sentinel)
    if kind == Outcome.DONE:
        return Verdict(State.PENDING, record.reopened, Action.LAUNCH) if record.reopened else Verdict(State.DONE)
    assert why is not None                 # every outcome but DONE says why (record.outcome)
    if a.stop is not None and a.stop.restart:
        return _restarting(a.stop, end.t, acting, host_now, attempts)
    if kind == Outcome.STOPPED:
        return Verdict(State.STOPPED, why, attempts=attempts)
    if awaiting_engine(a) and host_now < end.t + ENGINE_WORD_WAIT_S:
        return Verdict(State.FAILED, why, attempts=attempts)    # the agent records it in a moment
    return _failed(why, end.t, attempts, host_now, policy, a.failure_fatal)


def _live(record: ShardRecord, a: Attempt, acting: bool | None, host_now: float, policy: Policy, attempts: int,
          idle_s: float | None) -> Verdict:
    """The newest attempt (`a`, record.attempt) has a process that lives: its phase, a stop under
    way, a failure seen, a stall, or silence past a few of its usual intervals (LATE: nothing is
    done about it yet)."""
    phase = a.phase
    if policy.custom_job and phase == Phase.STARTING and a.pid is not None:
        phase = Phase.RUNNING
    if a.stop is not None:
        return _stopping(a.stop, acting, host_now, attempts)
    if a.failure is not None and a.queued and not a.failure_line:
        # An engine's task's `failed` is its last words before it exits (the engine signals every
        # process of a task it ends): its end, and the engine's account of it, say why.
        return Verdict(State(phase.value), f"ending: {a.failure}", attempts=attempts)
    if a.failure is not None:              # a fail line or `failed` while the process still runs
        return _kill_first(_failed(a.failure, a.failure_t or a.t, attempts, host_now, policy,
                                   a.failure_fatal))
    idle = idle_s if idle_s is not None else host_now - a.last_progress_t
    if phase == Phase.RUNNING and policy.stall_timeout is not None and idle > policy.stall_timeout:
        why = f"no progress for {idle:.0f}s"
        if not policy.restart_stalled:
            return Verdict(State.STALLED, why, attempts=attempts)
        v = _failed(why, host_now - idle + policy.stall_timeout, attempts, host_now, policy,
                    min_delay=STALL_SHOWN_S)
        return _kill_first(v) if v.state == State.FATAL else \
            Verdict(State.STALLED, v.reason, v.action, v.due_t, attempts)
    if phase == Phase.RUNNING and not a.worked and not policy.custom_job:
        return Verdict(State.LOADING, WARMING_UP, attempts=attempts)    # loaded, first batch not done
    late = progress_age(record, host_now, idle_s) if phase == Phase.RUNNING else None
    if late is not None and late.late:
        stall = f"; STALLED at {policy.stall_timeout:.0f}s" if policy.stall_timeout is not None else ""
        return Verdict(State.LATE, f"silent {late.age_s:.0f}s (usually {late.usual_s:.0f}s){stall}",
                       attempts=attempts)
    return Verdict(State(phase.value), a.shipping_note if phase == Phase.RUNNING else None,
                   attempts=attempts)


def _kill_first(v: Verdict) -> Verdict:
    """No live process in FATAL: a shard that gives up while its process lives is stopped first
    (STOPPING, action STOP); FATAL once its end is recorded."""
    if v.state != State.FATAL:
        return v
    return Verdict(State.STOPPING, f"{v.reason}; stopping what is left", Action.STOP, attempts=v.attempts)


def _stopping(stop: protocol.StopRequested, acting: bool | None, host_now: float, attempts: int) -> Verdict:
    """A stop or restart under way while the process lives: the SIGKILL countdown. If no actor is
    left on the host long after the SIGKILL was due (it died with its host's reboot), again."""
    grace = stop.grace if stop.grace is not None else 10.0
    kill_t = stop.t + grace
    what = "restarting" if stop.restart else "giving up" if stop.why == "fatal" else "stopping"
    if stop.reason and stop.why != "user":
        what += f" ({stop.reason})"
    left = kill_t - host_now
    reason = f"{what}; SIGKILL in {left:.0f}s" if left > 0 else f"{what}; SIGKILL sent"
    action = Action.NONE
    if acting is False and host_now > kill_t + STOP_STUCK_S:
        action = Action.RESTART if stop.restart else Action.STOP
    return Verdict(State.STOPPING, reason, action, kill_t, attempts, by=stop.by or "auto")


def _restarting(stop: protocol.StopRequested, ended_t: float, acting: bool | None, host_now: float,
                attempts: int) -> Verdict:
    """The old process is gone; the restart's launch is its actor's. With no actor on the host
    (an engine's task: the supervisor resubmits; or the actor died) the supervisor launches, as the intent says."""
    why = f"restarting ({stop.reason})" if stop.reason else "restarting"
    if acting:
        return Verdict(State.STOPPING, why, attempts=attempts, by=stop.by or "auto")
    due = ended_t + (HANDOFF_S if acting is False else 0.0)
    return Verdict(State.STOPPING, why, Action.RESTART if host_now >= due else Action.NONE, due, attempts,
                   by=stop.by or "auto")


def _failed(why: str, failed_t: float, attempts: int, host_now: float, policy: Policy,
            not_retryable: bool = False, min_delay: float = 0.0) -> Verdict:
    if not_retryable:
        return Verdict(State.FATAL, f"{why} (not retried by itself: its next launch would fail the same way)",
                       attempts=attempts)
    if attempts >= policy.max_restarts:
        return Verdict(State.FATAL, f"gave up after {policy.max_restarts} restart(s); last: {why}",
                       attempts=attempts)
    delay = max(backoff_delay(attempts, policy.backoff_base, policy.backoff_max), min_delay)
    due = failed_t + delay
    return Verdict(State.BACKOFF, f"{why}; restart in {delay:g}s",
                   Action.RESTART if host_now >= due else Action.NONE, due, attempts)


# --- rates --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rates:
    samples_per_s: float
    tokens_per_s: float
    bytes_per_s: float


def rates(record: ShardRecord, state: State, host_now: float, window: float = RATE_WINDOW_S) -> Rates | None:
    """Rates of the current attempt from its completed batches (issue 39): the work between the
    last batch and the last one that ended at least `window` s before it (else the attempt's first
    progress), over the time between them — so a shard whose batches take longer than the window
    never reads 0 between two of them. Once the next batch is later than the shard's usual
    interval between batches, the rate decays as usual / time since the last one, and it is 0 once
    none has ended for `window` s and STALE_BATCHES usual intervals. Times are the rows' count times
    (`counted_t`), not the progress ticks'. None (not measured) unless RUNNING/STALLED with two
    progress points, so a restarted shard starts from no rate rather than its last process's."""
    a = record.attempt
    if a is None or state not in MEASURED or len(a.history) < 2:
        return None
    ends = a.ends                                # the batch ends, kept as the record folded
    last = ends[-1]
    since = host_now - last[0]
    tail = list(itertools.islice(ends, max(len(ends) - 9, 0), None))
    gaps = sorted(b[0] - x[0] for x, b in zip(tail, tail[1:]))
    usual = gaps[len(gaps) // 2] if gaps else 0.0
    if len(ends) < 2 or since >= max(window, STALE_BATCHES * usual):
        return Rates(0.0, 0.0, 0.0)
    ref = next((e for e in itertools.islice(reversed(ends), 1, None) if e[0] <= last[0] - window), ends[0])
    span = last[0] - ref[0]
    if span <= 0:
        return Rates(0.0, 0.0, 0.0)
    late = usual / since if since > usual else 1.0
    return Rates(*((last[i] - ref[i]) / span * late for i in (1, 2, 3)))


def _at(history, t: float, column: int) -> float:
    """A cumulative counter of an attempt's history at time t: linear between points, flat before
    the first point and after the last (no progress is invented outside what was recorded)."""
    if t <= history[0][0]:
        return history[0][column]
    if t >= history[-1][0]:
        return history[-1][column]
    i = bisect_right(history, t, key=lambda p: p[0])
    (t0, *a), (t1, *b) = history[i - 1], history[i]
    v0, v1 = a[column - 1], b[column - 1]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else v1


def throughput_history(records, now: float, step: float, points: int) -> list[tuple[float, float, float]]:
    """The fleet's throughput over the last `points` intervals of `step` s up to `now`, rebuilt from
    the records (what a re-attached view draws before it has watched anything): `records` is
    (ShardRecord, clock offset = host clock - the caller's clock) pairs; returns (interval end,
    tokens/s, samples/s) in the caller's clock. Only each shard's current attempt is in its
    record, and a replay thins old progress (to one point a minute), so older intervals are
    smoothed, never invented."""
    edges = [now - step * (points - i) for i in range(points + 1)]
    tokens = [0.0] * points
    samples = [0.0] * points
    for record, offset in records:
        a = record.attempt
        if a is None or len(a.history) < 2:
            continue
        h = [(t - offset, *rest) for t, *rest in a.history]
        if h[-1][0] <= edges[0]:
            continue
        for column, out in ((1, samples), (2, tokens)):
            before = _at(h, edges[0], column)
            for i in range(points):
                after = _at(h, edges[i + 1], column)
                out[i] += (after - before) / step
                before = after
    return [(edges[i + 1], tokens[i], samples[i]) for i in range(points)]


def policy_for(config) -> Policy:
    """The judge's policy from fleet.toml's [supervise] (and [job]: a job without progress lines
    cannot stall; one with a done sentinel must print it)."""
    sup, job = config.spec.supervise, config.spec.job
    has_progress = job is None or bool(job.progress or job.progress_glob)
    return Policy(max_restarts=sup.max_restarts, backoff_base=sup.backoff_base,
                  backoff_max=sup.backoff_max,
                  stall_timeout=sup.stall_timeout if has_progress else None,
                  restart_stalled=sup.restart_stalled, needs_done_sentinel=bool(job and job.done),
                  custom_job=job is not None)
