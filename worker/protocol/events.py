"""The events of a shard's record: the one truth its state is built from, on both sides (fleet's
judge folds them into a ShardRecord, the host's worker.launches into a LaunchState). They are
appended to the shard's ``<shard dir>/events.jsonl`` at the moment they are observed, stamped with
the host's clock, and never rewritten. Each carries ``launch``, the number of the launch it belongs
to (1, 2, ...). Who writes what::

    hostctl launch   Launch         the lock is taken; the process is about to start
    engine submit    Launch (launcher=<engine>) before the engine is asked, then Submitted (its
                     task) or a failure (worker/engine/: an engine that queues tasks)
    the task runner  Started (node, job, gpus) inside an engine's task, then as the runner below
    the worker       Started Loading Loaded Progress SampleSkipped WarningEvent Done Failed
    the runner       Sentinel, Progress   a [job]'s log lines / output files, as they appear
                     Exited         the process ended (code, or stopped on purpose)
    hostctl act      StopRequested  the intent (stop, restart, give up), before the first signal;
                     Launch         for a restart, once the old process group is gone
    hostctl reopen   Reopened       `fleet verify --repair` dropped some of its samples
    worker.relocate  Relocated      rows of a lost host adopted here, or (back) moved away from
                     Reopened       here; a finished shard of the pool that adopted rows has work
    the agent        Exited(vanished=True)   the lock is free and the launch has no end record
                                    (the runner itself was killed); written under the lock
                     TaskEnded      the engine's final word on a launch's task (once, when first
                                    seen), then Exited(vanished=True) if the task never recorded its end
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from .records import EVENT_TYPES, Record, event, now


class Event(Record):
    """Any event of a shard's record: each one has the host's time it was observed and the launch
    it belongs to (declared here for the readers; each event's dataclass holds its own fields)."""
    t: float
    launch: Optional[int]


@event
@dataclass
class Launch(Event):
    KIND: ClassVar[str] = "launch"
    t: float = field(default_factory=now)
    launch: int = 1
    by: str = "manual"                 # manual | auto
    gpu: Optional[int] = None
    argv: Optional[list] = None
    runner_pid: Optional[int] = None
    launcher: Optional[str] = None     # the engine that queued it as a task (None: hostctl launch)


@event
@dataclass
class Started(Event):
    KIND: ClassVar[str] = "started"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    pid: Optional[int] = None
    host: Optional[str] = None
    device: Optional[str] = None
    shard: Optional[int] = None
    num_shards: Optional[int] = None
    start: Optional[int] = None
    stop: Optional[int] = None
    total: Optional[int] = None
    node: Optional[str] = None         # an engine's task: the node it runs on
    job: Optional[str] = None          # an engine's task: the engine's name for it
    gpus: Optional[list] = None        # an engine's task: the node's GPU indices it was given
    total_tokens: Optional[int] = None  # the shard's tokens to extract, when already known
    num_rows: Optional[int] = None     # the dataset's rows (every shard's range follows from it)


@event
@dataclass
class Submitted(Event):
    """The engine accepted the launch: its task is `job`, in the engine's own naming."""
    KIND: ClassVar[str] = "submitted"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    job: str = ""


# How an engine's task ended, in words every engine's host side translates its own into
# (worker/engine/): the judge reads these, never an engine's state names.
TASK_ENDS = ("completed", "failed", "cancelled", "time_limit", "preempted", "node_lost", "boot_failed",
             "deadline", "out_of_memory", "revoked", "unknown")
# The ends in which the engine, not the shard, ended the task: the only ones worth recording after
# the task recorded its own end (then they say why it failed).
ENGINE_ENDED = frozenset({"cancelled", "time_limit", "preempted", "node_lost", "boot_failed", "deadline",
                          "out_of_memory", "revoked"})
# While a task lives: waiting in the engine's queue, running, or being ended by the engine.
TASK_PHASES = ("queued", "running", "ending")


@event
@dataclass
class TaskEnded(Event):
    """The engine's final word on the launch's task, written once by whoever first sees it (the
    agent, or a submit/cancel on the engine's login node). `end` is one of TASK_ENDS; `state` and
    `reason` are the engine's own words (NODE_FAIL, NodeDown), `engine` its name for people."""
    KIND: ClassVar[str] = "task_end"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    job: str = ""
    end: str = "unknown"
    state: str = "UNKNOWN"
    reason: Optional[str] = None
    node: Optional[str] = None
    engine: str = ""


@event
@dataclass
class Loading(Event):
    KIND: ClassVar[str] = "loading"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    model: Optional[str] = None
    detail: Optional[str] = None       # what loading is doing now ("compiling the decoder layers")


@event
@dataclass
class Loaded(Event):
    KIND: ClassVar[str] = "loaded"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    seconds: Optional[float] = None
    gpu_mem_bytes: Optional[int] = None
    gpu_peak_bytes: Optional[int] = None
    layer_ids: Optional[list] = None
    last_layer_norm: Optional[str] = None
    path: Optional[str] = None         # which forward path runs and why ("compiled …", "eager: …")
    cpu_tokens_per_s: Optional[float] = None   # on a CPU: the forwards timed at load (the expected figure)


@event
@dataclass
class Progress(Event):
    """Cumulative counters of the shard (finished samples include those of earlier launches).
    `total_tokens`: the tokens of every row of the shard that will be extracted (whole shard, done
    or not), sent once the worker has read the rows' lengths; ETAs and throughput compare in
    tokens from then on, since samples are length-sorted and samples/s swings.
    The cost of the work, for an ETA that holds while rows get shorter (fleet/figures.py): a row of
    L tokens costs about L + attention_weight x L^2 (its attention), so the worker also sends
    `total_rows` and `total_sq_tokens` (the rows and the sum of L^2 over the whole shard, with
    `total_tokens`), `sq_tokens` (the sum of L^2 over the finished rows) and `attention_weight`
    (a FLOP model of the model's shape, or on a CPU the weight the worker timed at load: a prior,
    which the supervisor corrects by fitting), and
    `batches_from`, when the launch's first batch began, so the first batch is timed from its
    start and not from the last progress tick before it, and `counted_t`, when the rows last
    written were counted: progress goes out on a timer, so the tick's own time is up to a tick
    after the write it reports, and the fit times each batch from `counted_t` to `counted_t`.
    All optional: a record without them folds as before."""
    KIND: ClassVar[str] = "progress"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    done: int = 0
    skipped: int = 0
    total: Optional[int] = None
    tokens: Optional[int] = None
    total_tokens: Optional[int] = None
    sq_tokens: Optional[int] = None
    total_rows: Optional[int] = None
    total_sq_tokens: Optional[int] = None
    attention_weight: Optional[float] = None
    batches_from: Optional[float] = None   # when this launch's first batch began (loading and reading done)
    counted_t: Optional[float] = None      # when the counters last moved (the write they report)
    bytes: Optional[int] = None
    writer_wait_s: Optional[float] = None   # this launch's seconds the forward waited for a host buffer
    ship_wait_s: Optional[float] = None     # of the writer's, the seconds it waited for keep_local room
    host_buffer_bytes: Optional[int] = None
    gpu_mem_bytes: Optional[int] = None
    gpu_peak_bytes: Optional[int] = None


@event
@dataclass
class SampleSkipped(Event):
    KIND: ClassVar[str] = "sample_skipped"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    index: Optional[int] = None
    reason: str = ""


@event
@dataclass
class WarningEvent(Event):
    KIND: ClassVar[str] = "warning"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    message: str = ""


@event
@dataclass
class Done(Progress):
    """The shard's work is complete: its final counters."""
    KIND: ClassVar[str] = "done"
    host_peak_bytes: Optional[int] = None


@event
@dataclass
class Failed(Event):
    KIND: ClassVar[str] = "failed"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    reason: str = "failed"
    exit_code: Optional[int] = None
    traceback: Optional[list] = None
    fatal: bool = False               # a restart would fail the same way: do not retry


@event
@dataclass
class Sentinel(Event):
    """A [job]'s log line matched its `done` or `fail` regex (written by the runner)."""
    KIND: ClassVar[str] = "sentinel"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    match: str = "fail"               # done | fail
    line: str = ""


@event
@dataclass
class StopRequested(Event):
    """An intent, written by `hostctl act` (or an engine's `cancel`) before the first signal: the
    launch ends as this says, however it dies. `why`: user (k, :stop: never restarted by itself) |
    run (D, fleet down: the same, for the whole run) | restart (a restart's stop; `then` = "launch":
    the actor launches again once the process group is gone, by = manual for the user's restart,
    auto for the policy's) | fatal (the policy gave up: what is left of the shard is killed). A user
    or run stop written after the launch ended still applies: a shard waiting for a restart is
    STOPPED and never relaunched. `grace`: seconds between SIGTERM and SIGKILL."""
    KIND: ClassVar[str] = "stop"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    why: str = "user"
    reason: Optional[str] = None      # for a restart: the failure it restarts from
    then: Optional[str] = None        # "launch": a restart
    by: Optional[str] = None          # the relaunch's `by` (manual | auto)
    grace: Optional[float] = None

    @property
    def restart(self) -> bool:
        return self.then == "launch"

    @property
    def final(self) -> bool:
        """A stop the user (or `fleet down`) asked for: the shard stays STOPPED."""
        return self.why in USER_STOPS


USER_STOPS = ("user", "run")


@event
@dataclass
class Reopened(Event):
    """`fleet verify --repair` dropped samples of this shard: a DONE shard has work again."""
    KIND: ClassVar[str] = "reopened"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    samples: int = 0
    reason: str = ""


@event
@dataclass
class Checked(Event):
    """The shard's reference checks so far (worker/reference.py): rows re-computed alone through
    the model's plain forward and compared with what was written; per saved layer (`layer_ids`) the
    worst cosine and relative error; `failed`: why the newest one failed (the shard stops)."""
    KIND: ClassVar[str] = "checked"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    rows: int = 0
    layer_ids: list = field(default_factory=list)
    worst_cosine: list = field(default_factory=list)
    worst_rel_err: list = field(default_factory=list)
    seconds: float = 0.0
    masks: int = 0                  # of them, raw chats whose loss mask was checked (worker/maskcheck.py)
    failed: Optional[str] = None


@event
@dataclass
class Shipping(Event):
    """Where the shard's finished files stand against the run's destination (worker/ship.py), sent
    every few seconds while any are moving or waiting. `shipped_*`: its files the destination holds
    (checksum matched, gone from the local disk), over every launch; `local_bytes`/`pending_files`:
    its written files still on the local disk; `rate_bps`: bytes a second over the last transfer;
    `waiting`: why its writer waits (its local bytes at `keep_local`), not a stall; `error`: the last
    transfer's failure, retried (never a failure of the shard)."""
    KIND: ClassVar[str] = "shipping"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    destination: str = ""
    shipped_files: int = 0
    shipped_bytes: int = 0
    local_bytes: int = 0
    pending_files: int = 0
    rate_bps: Optional[float] = None
    waiting: Optional[str] = None
    error: Optional[str] = None
    finished: bool = False               # every file of the shard is at the destination


@event
@dataclass
class Leased(Event):
    """The shard holds rows [start, stop) of its host's pool (worker/leases.py): its planned
    range (`how` "plan"), a dead slot's lease taken over ("dead", `from_shard`), the second half
    of a live one's remainder ("stolen"), rows of a lost host ("adopted", `from_host`) or the rest
    of a lease stopped when its host came back from lost ("freed"). `rows`:
    those not yet finished; `epoch`: the lease's."""
    KIND: ClassVar[str] = "leased"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    start: int = 0
    stop: int = 0
    rows: int = 0
    epoch: int = 0
    how: str = "plan"
    from_shard: Optional[int] = None
    from_host: Optional[str] = None       # "adopted": rows of this lost host (fleet/relocate.py)


@event
@dataclass
class LeaseMoved(Event):
    """Rows [start, stop) this shard held went to `to_shard` (`rows` of them unfinished): taken over
    because this shard's process is gone (`why` "dead", written by the taker into this shard's
    record), or given up on a steal (`why` "stolen", written by this shard). `total`, `done`,
    `skipped`: this shard's rows after the move (those of the leases that count for it, and what of
    them is finished); `holds`: whether it still holds any."""
    KIND: ClassVar[str] = "lease_moved"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    start: int = 0
    stop: int = 0
    rows: int = 0
    to_shard: Optional[int] = None
    why: str = "dead"
    total: Optional[int] = None
    done: Optional[int] = None
    skipped: Optional[int] = None
    holds: bool = False


@event
@dataclass
class Relocated(Event):
    """Rows [start, stop) moved from the host `from_host` — lost for `[supervise] host_lost_after`,
    or reachable with every shard FATAL or stopped while holding rows (`why` "idle"), or no longer
    in fleet.toml — to the host `to_host` (fleet/relocate.py, through `worker.relocate`). Written on the
    receiving host into its pool's first shard (`side` "in", when they are adopted) and, once the
    lost host is back, into each of its pool's shards (`side` "out": it holds them no more, and
    the copies it wrote of them are removed by `fleet verify --repair`). `redone`: the rows the
    lost host had reported finished, done again. The supervisor reads from both sides which moves
    the lost host has still to be told of."""
    KIND: ClassVar[str] = "relocated"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    start: int = 0
    stop: int = 0
    from_host: str = ""
    to_host: str = ""
    side: str = "in"
    redone: int = 0
    why: str = "lost"          # lost (unreachable) | idle (reachable, no GPU of it can go on) | removed


@event
@dataclass
class Exited(Event):
    """The launch ended: `code` (negative: killed by that signal; None: unknown), `stopped` (the
    runner was told to stop it), `vanished` (written by the agent: the runner died too)."""
    KIND: ClassVar[str] = "exited"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    code: Optional[int] = None
    pid: Optional[int] = None
    stopped: bool = False
    vanished: bool = False




# Events after which a launch has made progress (the judge's last progress time moves on them).
PROGRESS_EVENTS = (Launch, Loaded, Progress)


def parse_event(d: Any) -> Optional[Event]:
    """A typed event from a JSON object, or None for anything that is not one (a line written by
    a newer worker, a hand edit): the record must never crash the reader."""
    if not isinstance(d, dict):
        return None
    cls = EVENT_TYPES.get(d.get("event", ""))
    if cls is None:
        return None
    try:
        ev = cls.from_dict(d)
        ev.t = float(ev.t)
        if ev.launch is not None:
            ev.launch = int(ev.launch)
    except (TypeError, ValueError):
        return None
    return ev
