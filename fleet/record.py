"""A shard's record folded into what happened: launches, the current attempt, counters, history.

Pure and incremental: `ShardRecord.apply(event)` for each typed event of the shard's events.jsonl,
in file order. The live stream and a one-shot replay apply the same events in the same order, so
they reach the same record at every prefix. What the record *means now* (state, what to do) is the
judge's business (fleet.judge); this module only says how an ended attempt ended.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from worker import protocol
from worker.text import exit_words as describe_exit

from .bound import Point, Wait, recent, whole

HISTORY_POINTS = 600               # progress points kept per attempt (bounded memory)


class Phase(str, Enum):
    STARTING = "STARTING"
    LOADING = "LOADING"
    RUNNING = "RUNNING"


class Outcome(str, Enum):
    DONE = "done"
    STOPPED = "stopped"
    RESTARTED = "restarted"           # stopped for the user's own restart: never a failure
    FAILED = "failed"


@dataclass
class Attempt:
    """One launch of the shard and everything its record says about it."""
    n: int
    t: float
    by: str
    gpu: int | None
    phase: Phase = Phase.STARTING
    detail: str | None = None             # what loading is doing ("compiling the decoder layers")
    pid: int | None = None
    last_progress_t: float = 0.0
    done_event: bool = False              # the built-in worker's `done`
    done_sentinel: bool = False           # a [job]'s done line
    failure: str | None = None            # a `failed` event or a fail line, while it ran
    failure_t: float | None = None
    failure_fatal: bool = False           # the process said a restart would fail the same way
    failure_line: bool = False            # the failure is a [job]'s fail line (it may carry on)
    stop: protocol.StopRequested | None = None
    end: protocol.Exited | None = None
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    # Read off the history as each point is folded, so the judge and every picture read them
    # without walking 600 points a shard each second: (count time, samples, tokens, bytes) of the
    # first point and of every point where the counters moved (a batch written; judge.rates), and,
    # by history column (1 samples, 2 tokens), the points where it moved to above 0 (figures.pace).
    ends: deque = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))
    moved: dict = field(default_factory=lambda: {1: deque(maxlen=HISTORY_POINTS), 2: deque(maxlen=HISTORY_POINTS)})
    launcher: str | None = None           # the engine that queued it as a task (None: hostctl on a host)
    job: str | None = None                # its task, in the engine's naming
    node: str | None = None               # the node it ran on (its `started`)
    gpus: list | None = None              # the node's GPU indices the engine gave it
    task_end: protocol.TaskEnded | None = None   # the engine's final word on its task
    base_done: int = 0                    # samples finished (or skipped) before this launch
    worked: bool = False                  # this launch has finished a sample (warm-up is over)
    batches_from: float | None = None     # when its first batch began (the worker's `batches_from`)
    shipping_note: str | None = None      # why it waits on shipping, or shipping's failure (retried)
    waits: deque = field(default_factory=lambda: deque(maxlen=HISTORY_POINTS))  # bound.Point, as told

    @property
    def recent_wait(self) -> Wait:
        """Its last minute of batches: how long its GPU waited, and for what (fleet/bound.py)."""
        return recent(self.waits)

    @property
    def whole_wait(self) -> Wait:
        return whole(self.batches_from, self.waits)

    @property
    def ended(self) -> bool:
        return self.end is not None

    @property
    def queued(self) -> bool:
        """An engine queued it as a task (worker/engine/): the engine, not fleet, may end it."""
        return self.launcher is not None


# Ends in which the engine, not the shard, ended the task (protocol.ENGINE_ENDED): why the shard failed.
ENGINE_ENDS = {
    "cancelled": "cancelled outside fleet (by an admin, or the engine's own command)",
    "time_limit": "the task reached its time limit",
    "preempted": "preempted by a job of higher priority",
    "node_lost": "its node failed",
    "boot_failed": "its node failed to boot",
    "deadline": "the job reached its deadline",
    "out_of_memory": "out of memory (the engine's limit)",
    "revoked": "revoked by the engine",
}


def task_end_reason(end: protocol.TaskEnded) -> str:
    """'<engine> NODE_FAIL on node07: its node failed (NodeDown)': the engine's name and words, then
    what the neutral end means)."""
    where = f" on {end.node}" if end.node else ""
    what = ENGINE_ENDS.get(end.end, "")
    return f"{end.engine or 'the engine'} {end.state}{where}" + (f": {what}" if what else "") + \
        (f" ({end.reason})" if end.reason else "")


def awaiting_engine(a: Attempt) -> bool:
    """A task that ended by a signal with no stop of fleet's, and the engine's final word not yet
    recorded: the engine ended it, and why (time limit, preemption, node failure, someone's cancel)
    is the engine's to say (the agent records it once the task's state is final). A launch the
    engine refused never reached it (no job): it has nothing to say."""
    end = a.end
    return a.queued and a.job is not None and a.stop is None and a.task_end is None and end is not None and \
        not end.vanished and (end.stopped or end.code is None or end.code < 0)


def outcome(a: Attempt, needs_done_sentinel: bool) -> tuple[Outcome, str | None]:
    """How an ended attempt ended, and why when it was not DONE."""
    end = a.end
    assert end is not None
    if _finished(a, end, needs_done_sentinel):
        return Outcome.DONE, None
    intended = _intended_end(a, end)
    if intended is not None:
        return intended
    return Outcome.FAILED, _task_failure(a, end) or _failure_reason(a, end)


def _finished(a: Attempt, end: protocol.Exited, needs_done_sentinel: bool) -> bool:
    """Exit 0 with no failure seen counts as DONE only with the done signal a [job] with a `done`
    regex must give (the built-in worker's `done` event also counts)."""
    return end.code == 0 and a.failure is None and (
        a.done_event or a.done_sentinel or not needs_done_sentinel)


def _intended_end(a: Attempt, end: protocol.Exited) -> tuple[Outcome, str] | None:
    """An end someone asked for is never a failure: a user's (or the run's) stop, a plain stop of
    a hostctl launch with no intent recorded, or the user's own restart."""
    if (a.stop is not None and a.stop.final) or (end.stopped and a.stop is None and not a.queued):
        return Outcome.STOPPED, "stopped"
    if a.stop is not None and a.stop.restart and a.stop.by == "manual":
        return Outcome.RESTARTED, "restarted by the user"
    return None


def _task_failure(a: Attempt, end: protocol.Exited) -> str | None:
    """Why a task failed when its engine, not the shard, ended it (or may have: then the reason
    says it waits for the engine's final word); None to judge it by the task's own record."""
    if a.queued and a.stop is None and a.task_end is not None:
        if a.task_end.end in ENGINE_ENDS:
            return task_end_reason(a.task_end)
        if end.vanished:
            return f"the task ended without recording how; {task_end_reason(a.task_end)}"
        return None
    if awaiting_engine(a):
        sig = f" (signal {-end.code})" if end.code is not None and end.code < 0 else ""
        return f"ended by {a.launcher}{sig}; waiting for {a.launcher}'s final word"
    return None


def _failure_reason(a: Attempt, end: protocol.Exited) -> str:
    """Why a failed attempt failed, by its own record: what it said, the restart's reason, or how
    the process ended."""
    if a.failure:
        return a.failure
    if a.stop is not None:
        return a.stop.reason or "stopped for a restart"
    if end.vanished:
        return "process vanished without an exit status"
    if end.code == 0:
        return "exited 0 without the done sentinel"
    return describe_exit(end.code)


@dataclass
class ShardRecord:
    needs_done_sentinel: bool = False     # a [job] with a `done` regex: exit 0 alone is not DONE
    launches: int = 0
    auto_attempts: int = 0                # automatic launches since the last manual one
    first_launch_t: float | None = None
    attempt: Attempt | None = None
    done: int = 0
    skipped: int = 0
    total: int = 0
    tokens: int = 0
    total_tokens: int | None = None       # the shard's tokens to extract, once the worker read them
    sq_tokens: int = 0                    # the sum of each finished row's tokens squared (its attention)
    total_rows: int | None = None         # the cost of the whole shard's work, once the worker read
    total_sq_tokens: int | None = None    # its rows: rows and the sum of tokens squared (fleet/figures.py)
    attention_weight: float | None = None # the worker's FLOP model: a row costs ~ L + weight x L^2
    bytes: int = 0
    writer_wait_s: float = 0.0
    gpu_mem_bytes: int | None = None
    warning: str | None = None            # the newest attempt's newest warning, until it is done
    path: str | None = None               # the forward path the worker chose, and why
    last_event: str | None = None
    last_event_t: float | None = None
    last_failure: str | None = None       # why the newest failed attempt failed
    last_failure_t: float | None = None
    failures: int = 0                     # attempts that ended FAILED, ever
    reopened: str | None = None           # samples dropped since the newest attempt ended
    unlaunched_stop: protocol.StopRequested | None = None   # a run stop before its first launch
    lease: str | None = None              # the rows it holds now and how it got them (worker/leases.py)
    rows_in: int = 0                      # unfinished rows it took from other shards of its host
    rows_out: int = 0                     # unfinished rows other shards took from it
    holds_rows: bool = True               # False once a dead launch's lease went to another shard
    num_rows: int | None = None           # the dataset's rows, as its worker counted them
    cpu_tokens_per_s: float | None = None # on a CPU, what its worker timed at load
    planned: tuple[int, int] | None = None   # the plan's rows of this shard
    leased_t: float | None = None         # when it last took a lease (newer than a relocation: holds rows)
    shipping: protocol.Shipping | None = None   # its files against the destination, as last told
    checked: protocol.Checked | None = None     # its reference checks so far (worker/reference.py)
    past_wait: Wait = field(default_factory=Wait)   # the GPU's waits over the batches of earlier launches

    @property
    def whole_wait(self) -> Wait:
        """The GPU's waits over every batch of every launch (fleet/bound.py)."""
        return self.past_wait + (self.attempt.whole_wait if self.attempt is not None else Wait())

    def apply(self, ev: protocol.Event) -> None:
        """Fold one event of the shard's record, in file order."""
        a = self._attempt_of(ev)
        if a is None:
            return
        self.last_event, self.last_event_t = ev.KIND, ev.t
        if isinstance(ev, (protocol.Submitted, protocol.TaskEnded)):
            self._task(a, ev)                 # the engine's word may come after the task's own end
        elif a.ended:
            if isinstance(ev, protocol.StopRequested):    # an intent for an ended attempt: a stop
                a.stop = newer_intent(a.stop, ev)         # or restart of a shard that is not running
            elif isinstance(ev, protocol.Shipping):       # its files, shipped by a mate after its end
                self.shipping = ev
            # nothing else changes an attempt after its end
        else:
            self._running(a, ev)

    def _attempt_of(self, ev: protocol.Event) -> Attempt | None:
        """The current attempt when `ev` is about it; None when `ev` is about the shard itself (a
        launch, a reopening, a stop before the first launch: folded here) or about nothing now
        (before any launch, or another launch's leftover)."""
        a = self.attempt
        if isinstance(ev, protocol.Launch):
            self._launch(ev)
            return None
        if isinstance(ev, protocol.LeaseMoved):           # written by the taker, or by the shard itself
            self._lease_moved(ev)
            return None
        if isinstance(ev, protocol.Relocated):
            self._relocated(ev)
            return None
        if isinstance(ev, protocol.Reopened):    # (a running attempt may be ending: it holds for after)
            if a is not None:
                self.reopened = f"{ev.samples} sample(s) to redo: {ev.reason}"
            return None
        if a is None and isinstance(ev, protocol.StopRequested):
            if ev.final:                                  # the run stopped before it ever ran
                self.unlaunched_stop = newer_intent(self.unlaunched_stop, ev)
            return None
        if a is None or (ev.launch is not None and ev.launch != a.n):
            return None
        return a

    def _running(self, a: Attempt, ev: protocol.Record) -> None:
        """An event of the attempt while it runs: the shard's own word about itself."""
        if isinstance(ev, protocol.Started):
            self._started(a, ev)
        elif isinstance(ev, protocol.Loading):
            a.phase, a.detail = Phase.LOADING, ev.detail
        elif isinstance(ev, protocol.Loaded):
            a.phase, a.last_progress_t, a.detail = Phase.RUNNING, ev.t, None
            self.path = ev.path or self.path
            if ev.gpu_mem_bytes is not None:
                self.gpu_mem_bytes = ev.gpu_mem_bytes
            self.cpu_tokens_per_s = ev.cpu_tokens_per_s or self.cpu_tokens_per_s
        elif isinstance(ev, protocol.Progress):               # Done is a Progress too
            self._progress(a, ev)
        elif isinstance(ev, protocol.WarningEvent):
            self.warning = ev.message
        elif isinstance(ev, protocol.Leased):
            self._leased(ev)
        elif isinstance(ev, protocol.Checked):
            self.checked = ev
        elif isinstance(ev, protocol.Shipping):
            self.shipping = ev
            a.shipping_note = ev.waiting or (f"shipping failed, retrying: {ev.error}" if ev.error else None)
        elif isinstance(ev, (protocol.Failed, protocol.Sentinel)):
            self._said(a, ev)
        elif isinstance(ev, protocol.StopRequested):
            a.stop = newer_intent(a.stop, ev)
        elif isinstance(ev, protocol.Exited):
            self._exited(a, ev)

    def _started(self, a: Attempt, ev: protocol.Started) -> None:
        """The process (or its engine's task) is up: its pid, where it runs, the shard's size."""
        a.pid = ev.pid if ev.pid is not None else a.pid
        if ev.total is not None:
            self.total = ev.total
        a.node, a.job, a.gpus = ev.node or a.node, a.job or ev.job, ev.gpus or a.gpus
        if ev.total_tokens is not None:
            self.total_tokens = ev.total_tokens
        self.num_rows = ev.num_rows or self.num_rows
        if ev.start is not None and ev.stop is not None:
            self.planned = (ev.start, ev.stop)

    def _progress(self, a: Attempt, ev: protocol.Progress) -> None:
        """Counters (cumulative over launches), the attempt's warm-up and its history point;
        `done` marks the built-in worker's end of work."""
        self._count(ev)
        if getattr(ev, "batches_from", None) is not None:
            a.batches_from = ev.batches_from
        a.worked = a.worked or self.done + self.skipped > a.base_done
        if isinstance(ev, protocol.Done):
            a.done_event = True
            self.warning = None              # (of the work in progress: "retrying 106 row(s)" is over)
        else:
            a.phase = Phase.RUNNING
        a.last_progress_t = ev.t
        if ev.writer_wait_s is not None:
            waited: Point = (ev.t, ev.writer_wait_s, ev.ship_wait_s or 0.0)
            a.waits.append(waited)
        counted = ev.counted_t if ev.counted_t is not None and ev.counted_t <= ev.t else ev.t
        point = (ev.t, self.done + self.skipped, self.tokens, self.bytes, self.sq_tokens, counted)
        before = a.history[-1] if a.history else None
        a.history.append(point)
        if not a.ends or a.ends[-1][1:] != point[1:4]:
            a.ends.append((counted, *point[1:4]))
        for column in a.moved:
            if point[column] > 0 and (before is None or point[column] != before[column]):
                a.moved[column].append(point)

    @staticmethod
    def _said(a: Attempt, ev: protocol.Failed | protocol.Sentinel) -> None:
        """A `failed` event or a [job]'s sentinel line: the first failure said is the one kept."""
        if isinstance(ev, protocol.Sentinel) and ev.match == "done":
            a.done_sentinel = True
        elif a.failure is None:
            if isinstance(ev, protocol.Failed):
                a.failure, a.failure_t, a.failure_fatal = ev.reason, ev.t, bool(ev.fatal)
            else:
                a.failure, a.failure_t, a.failure_line = f"fail sentinel: {ev.line.strip()}", ev.t, True

    def _exited(self, a: Attempt, ev: protocol.Exited) -> None:
        """The attempt ended: count it when it failed, and remember why."""
        a.end = ev
        kind, why = outcome(a, self.needs_done_sentinel)
        if kind == Outcome.FAILED:
            self.failures += 1
            self.last_failure, self.last_failure_t = why, ev.t

    def _task(self, a: Attempt, ev) -> None:
        """`submitted` names the task; `task_end` is the engine's final word on it (the first one
        counts). After the attempt's end it can only refine why it failed."""
        if isinstance(ev, protocol.Submitted):
            a.job = a.job or ev.job
            return
        if a.task_end is not None:
            return
        a.task_end = ev
        a.node = a.node or ev.node
        if a.ended:
            kind, why = outcome(a, self.needs_done_sentinel)
            if kind == Outcome.FAILED:
                self.last_failure = why

    def _leased(self, ev: protocol.Leased) -> None:
        self.holds_rows, self.leased_t = True, ev.t
        where = f"rows {ev.start:,}–{ev.stop:,}"
        if ev.how == "plan":
            self.lease = where
            return
        self.rows_in += ev.rows
        self.lease = where + (f" (took {ev.rows:,} from dead shard {ev.from_shard})" if ev.how == "dead" else
                              f" (took {ev.rows:,} of lost host {ev.from_host})" if ev.how == "adopted" else
                              f" (took {ev.rows:,} of a lease stopped when its host came back)"
                              if ev.how == "freed" else f" (stole {ev.rows:,} from shard {ev.from_shard})")

    def _relocated(self, ev: protocol.Relocated) -> None:
        """Its host was lost and its rows went to another host: once it is back, it holds none."""
        if ev.side != "out":
            return
        self.holds_rows = False
        if self.planned is not None:          # every shard of the host is told; each counts its own rows
            self.rows_out += max(0, min(ev.stop, self.planned[1]) - max(ev.start, self.planned[0]))
        self.lease = f"none: rows {ev.start:,}–{ev.stop:,} went to {ev.to_host} (this host was lost)"
        self.last_event, self.last_event_t = ev.KIND, ev.t

    def _lease_moved(self, ev: protocol.LeaseMoved) -> None:
        """Rows this shard held went to another: its total (and, when taken over, its counts) are
        what its remaining leases hold."""
        self.rows_out += ev.rows
        self.holds_rows = ev.holds
        if ev.total is not None:
            self.total = ev.total
        if ev.done is not None:
            self.done, self.skipped = ev.done, ev.skipped or 0
        if not ev.holds:
            self.lease = f"none: rows {ev.start:,}–{ev.stop:,} went to shard {ev.to_shard}"
        self.last_event, self.last_event_t = ev.KIND, ev.t

    def _launch(self, ev: protocol.Launch) -> None:
        self.launches += 1
        self.warning = None                  # a warning is its attempt's
        self.auto_attempts = self.auto_attempts + 1 if ev.by == "auto" else 0
        if self.first_launch_t is None:
            self.first_launch_t = ev.t
        self.past_wait = self.whole_wait
        self.attempt = Attempt(n=ev.launch, t=ev.t, by=ev.by, gpu=ev.gpu, last_progress_t=ev.t,
                               launcher=ev.launcher, base_done=self.done + self.skipped)
        self.reopened = None
        self.unlaunched_stop = None
        self.last_event, self.last_event_t = ev.KIND, ev.t

    def _count(self, ev) -> None:
        self.done, self.skipped = ev.done, ev.skipped
        for key in ("total", "tokens", "total_tokens", "bytes", "writer_wait_s", "gpu_mem_bytes", "sq_tokens",
                    "total_rows", "total_sq_tokens", "attention_weight"):
            value = getattr(ev, key, None)
            if value is not None:
                setattr(self, key, value)


def newer_intent(held: protocol.StopRequested | None, new: protocol.StopRequested) -> protocol.StopRequested:
    """The intent that stands for an attempt: the newest, except that a restart never replaces a
    user's (or the run's) stop — a stop is never undone by a restart asked for after it."""
    if held is not None and held.final and not new.final:
        return held
    return new


def fold(events, needs_done_sentinel: bool = False) -> ShardRecord:
    record = ShardRecord(needs_done_sentinel=needs_done_sentinel)
    for ev in events:
        record.apply(ev)
    return record
