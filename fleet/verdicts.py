"""Why a verdict judged before still holds: the store judges a shard once for every reader (the
decide pass, the snapshot, a refusal) and again only when what `fleet.judge.judge` reads of it
changed, or when time alone would change what it says.

What the judge reads of a shard, besides the clocks, is `reads`: its record (a version, new with
each event folded), its process's life (`alive`, `acting`), the engine's word on its task (the
launch, phase and reason the judge looks at, not the poll's time), the launches that never reached
its host, and its host's down reason. A GPU or disk reading, a beat, a pid or a task's GPUs are not
in it: none of them re-judges a shard.

Time enters a verdict only at a few thresholds, and `holds` says how far the one just judged
reaches: on the host's clock, until a backoff's or a restart's handoff's restart is due, an
engine's word is no longer waited for, or a stop's SIGKILL is overdue; on the shard's silence (its
idle time, else the host time since its last progress), until it is LATE or STALLED. A verdict
whose words count seconds (STALLED, LATE, a SIGKILL's countdown) holds only at the moment it was
judged. Under a host that cannot be read the verdict is UNKNOWN and says only the state the record
gave, so only that state's thresholds count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from worker import protocol

from .figures import LATE_FACTOR, LATE_MIN_S, progress_age
from .judge import ENGINE_WORD_WAIT_S, STOP_STUCK_S, Policy, Verdict
from .record import Attempt, Phase, ShardRecord, awaiting_engine
from .state import State

INF = math.inf
TIMELESS = (State.PENDING, State.QUEUED, State.DONE, State.STOPPED, State.FATAL, State.UNKNOWN)


def reads(record_version: int, alive: bool | None, acting: bool | None, task: protocol.TaskState | None,
          launch_failures: int, down: str | None) -> tuple:
    """What the judge reads of a shard besides time (the launch failures: a list that only grows
    between two records, so its length)."""
    word = None if task is None else (task.launch, task.phase, task.reason)
    return record_version, alive, acting, word, launch_failures, down


@dataclass(frozen=True)
class Holds:
    """Where a verdict judged at host time `since` still holds, all it reads unchanged: host times
    in [since, until), and a silence of the shard (`age`) above `age_above` and at most `age_max`."""
    since: float
    until: float = INF
    age_above: float = -INF
    age_max: float = INF

    def covers(self, host_now: float, age: Callable[[], float]) -> bool:
        if not self.since <= host_now < self.until:
            return False
        return (self.age_above == -INF and self.age_max == INF) or self.age_above < age() <= self.age_max


def silence(record: ShardRecord, host_now: float, idle_s: float | None) -> float:
    """The shard's silence as the judge measures a stall: its idle time, else host time since its
    newest attempt's last progress (asked only of a verdict on a live attempt)."""
    if idle_s is not None:
        return idle_s
    assert record.attempt is not None
    return host_now - record.attempt.last_progress_t


def holds(record: ShardRecord, verdict: Verdict, host_now: float, policy: Policy, acting: bool | None,
          idle_s: float | None, state_only: bool = False) -> Holds:
    """How far `verdict`, just judged at `host_now` with `idle_s`, holds as time passes (see the
    module's words). `state_only`: only its state counts (its host is down: the verdict says the
    state alone)."""
    h, a, state = host_now, record.attempt, verdict.state
    if state == State.BACKOFF or (state == State.STOPPING and a is not None and a.ended):
        due = verdict.due_t                     # a failure's backoff, a restart's handoff: the action flips
        return Holds(h, due) if due is not None and h < due and not state_only else Holds(h)
    if state == State.FAILED:                   # the engine's word waited for, a while
        end = a.end if a is not None and a.ended and awaiting_engine(a) else None
        return Holds(h, end.t + ENGINE_WORD_WAIT_S) if end is not None else Holds(h)
    if state in TIMELESS or a is None or a.ended:
        return Holds(h)
    if state == State.STOPPING:
        return _stopping(a, verdict, h, policy, acting, state_only)
    return _live(record, a, verdict, h, policy, idle_s, state_only)


def _stopping(a: Attempt, verdict: Verdict, h: float, policy: Policy, acting: bool | None,
              state_only: bool) -> Holds:
    """A live process being stopped (its SIGKILL counted down, then overdue with no actor left), or
    one given up on: after a failure (no clock), or after a stall (its words count seconds)."""
    if state_only:
        return Holds(h) if a.stop is not None or a.failure is not None else \
            Holds(h, age_above=_stall(policy))
    if a.stop is not None:
        kill = verdict.due_t
        if kill is None or h < kill:
            return Holds(h, h)
        return Holds(h, kill + STOP_STUCK_S) if acting is False and h <= kill + STOP_STUCK_S else Holds(h)
    return Holds(h) if a.failure is not None else Holds(h, h)


def _live(record: ShardRecord, a: Attempt, verdict: Verdict, h: float, policy: Policy, idle_s: float | None,
          state_only: bool) -> Holds:
    """A live process: RUNNING until it is LATE or STALLED, LATE until STALLED; LOADING before its
    first batch until STALLED; no clock in any other phase, nor while it ends."""
    phase = a.phase
    if policy.custom_job and phase == Phase.STARTING and a.pid is not None:
        phase = Phase.RUNNING
    if phase != Phase.RUNNING or a.failure is not None:
        return Holds(h)
    stall = _stall(policy)
    if verdict.state == State.STALLED:
        return Holds(h, age_above=stall) if state_only else Holds(h, h)
    if verdict.state == State.LOADING:
        return Holds(h, age_max=stall)
    late = _late(record, h, idle_s)
    if verdict.state == State.LATE:
        return Holds(h, age_above=late, age_max=stall) if state_only else Holds(h, h)
    return Holds(h, age_max=min(stall, late))


def _stall(policy: Policy) -> float:
    return policy.stall_timeout if policy.stall_timeout is not None else INF


def _late(record: ShardRecord, h: float, idle_s: float | None) -> float:
    """The silence past which a running shard is LATE (`figures.progress_age`'s rule)."""
    age = progress_age(record, h, idle_s)
    usual = age.usual_s if age is not None else None
    return max(LATE_FACTOR * usual, LATE_MIN_S) if usual is not None else INF


@dataclass(frozen=True)
class Judged:
    """A shard's newest verdict: what it was judged from (`reads`) and how far it holds."""
    reads: tuple
    holds: Holds
    verdict: Verdict
