"""The wire format between workers, runners, the host agent and the supervisor: typed records.

Standard library only: this file travels to every GPU host and is imported by `fleet` too, so the
two sides can never disagree on a record. Every record is one JSON object on one line.

**Events** are what a shard's state is built from. They are appended to the shard's
``<shard dir>/events.jsonl`` at the moment they are observed, stamped with the host's clock, and
never rewritten. Each carries ``launch``, the number of the launch it belongs to (1, 2, ...).
Who writes what::

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

**Agent messages** are the agent's stdout, one per line, tagged by ``type``: Hello (first, with
PROTOCOL_VERSION), EventMessage, Liveness, GpuReading, DiskReading, Beat, Replayed, End, AgentError;
under an engine that queues tasks also TaskState (what the engine says of a live task now),
EnginePoll (whether the engine answered) and TaskGpus (the GPUs a task reported from inside its
allocation). Engines translate their own words into these where they enter (worker/engine/): no
record names an engine.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import time
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Optional

PROTOCOL_VERSION = 4

# --- remote layout -----------------------------------------------------------------------------
EVENTS_FILE = "events.jsonl"
REPLAY_RECENT_S = 120.0      # an agent's replay keeps every progress event this recent (older: thinned)
LOG_FILE = "log"
PID_FILE = "pid"
LOCK_FILE = "lock"
GPUS_FILE = "gpus.json"      # an engine task's latest reading of its own GPUs (replaced, not appended)
MANIFEST_DIR = "manifest"
META_FILE = "meta.json"
SAMPLE_PREFIX = "hs_"
SAMPLE_SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"        # temp files start with a dot: no `hs_*.safetensors` glob matches them
LAUNCH_ENV = "FLEET_LAUNCH"  # the launch number, handed to the shard process by its runner


def sample_file_name(index: int) -> str:
    return f"{SAMPLE_PREFIX}{index}{SAMPLE_SUFFIX}"


def shard_dir(run_dir: str, shard: int) -> str:
    return os.path.join(run_dir, "shards", str(shard))


def now() -> float:
    return round(time.time(), 3)


# --- records -----------------------------------------------------------------------------------

class Record:
    """A typed record. Subclasses are dataclasses whose fields all have defaults, so a record read
    from an older or newer peer still parses: unknown keys are dropped, missing ones defaulted."""

    TAG: ClassVar[str] = "event"      # the key that names the record's kind
    KIND: ClassVar[str]

    def to_dict(self) -> dict:
        out: dict = {self.TAG: self.KIND}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = _plain(value)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict):
        """The record of `d`; a field typed as a reply (a plan, GPU readings) is parsed and checked
        as one (ReplyError, a ValueError, where it is not)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        for name, hint in _typed_parts(cls).items():
            if kw.get(name) is not None:
                kw[name] = _check(kw[name], hint, f"{cls.KIND}.{name}")
        return cls(**kw)


def _plain(value: Any) -> Any:
    """A field's value as JSON: typed parts (replies, records) as their dicts, within lists and
    dicts too (Record.to_dict and Reply.to_dict both)."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


_PARTS: dict[type, dict[str, Any]] = {}


def _typed_parts(cls: type) -> dict[str, Any]:
    """The fields of a record class whose type names a Reply (alone, optional or in a list)."""
    if cls not in _PARTS:
        def names_reply(hint: Any) -> bool:
            if isinstance(hint, type):
                return issubclass(hint, Reply)
            return any(names_reply(a) for a in typing.get_args(hint))
        hints = typing.get_type_hints(cls)
        _PARTS[cls] = {f.name: hints[f.name] for f in dataclasses.fields(cls) if names_reply(hints[f.name])}
    return _PARTS[cls]


EVENT_TYPES: dict[str, type] = {}
MESSAGE_TYPES: dict[str, type] = {}


def event(cls):
    EVENT_TYPES[cls.KIND] = cls
    return cls


def message(cls):
    MESSAGE_TYPES[cls.KIND] = cls
    return cls


# --- typed parts and replies (their checked parsing; the replies themselves are further down) ---

class ReplyError(ValueError):
    """A reply whose JSON is not the record it should be (one line: which field, what it holds)."""


def _check(value: Any, hint: Any, where: str) -> Any:
    """`value` as the type `hint` says (nested replies parsed), or ReplyError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _check(value, inner[0], where)
    if isinstance(hint, type) and issubclass(hint, Reply):
        return hint.from_dict(value, where)
    if origin is list or hint is list:
        if not isinstance(value, list):
            raise ReplyError(f"{where}: a list expected, not {value!r:.80}")
        return [_check(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)] if args else value
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ReplyError(f"{where}: an object expected, not {value!r:.80}")
        return {k: _check(v, args[1], f"{where}.{k}") for k, v in value.items()} if args else value
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, hint)
    if not ok:
        raise ReplyError(f"{where}: {getattr(hint, '__name__', hint)} expected, not {value!r:.80}")
    return value


class Reply:
    """A typed reply (a dataclass). `to_dict` writes every field, None included, in declaration
    order; `from_dict` checks each field against its annotation."""

    @classmethod
    def from_dict(cls, d: Any, where: str | None = None):
        where = where or cls.__name__
        if not isinstance(d, dict):
            raise ReplyError(f"{where}: an object expected, not {d!r:.80}")
        hints = typing.get_type_hints(cls)
        return cls(**{f.name: _check(d[f.name], hints[f.name], f"{where}.{f.name}")
                      for f in dataclasses.fields(cls) if f.name in d})

    def to_dict(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)


class CompactReply(Reply):
    """A reply written without its unset (None) fields: a part that files keep and older readers
    compare key by key, where an absent key and a null one must read alike."""

    def to_dict(self) -> dict:
        return {k: v for k, v in super().to_dict().items() if v is not None}


# --- events (events.jsonl) ---------------------------------------------------------------------

@event
@dataclass
class Launch(Record):
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
class Started(Record):
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
class Submitted(Record):
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
class TaskEnded(Record):
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
class Loading(Record):
    KIND: ClassVar[str] = "loading"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    model: Optional[str] = None
    detail: Optional[str] = None       # what loading is doing now ("compiling the decoder layers")


@event
@dataclass
class Loaded(Record):
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
class Progress(Record):
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
    writer_wait_s: Optional[float] = None
    host_buffer_bytes: Optional[int] = None
    gpu_mem_bytes: Optional[int] = None
    gpu_peak_bytes: Optional[int] = None


@event
@dataclass
class SampleSkipped(Record):
    KIND: ClassVar[str] = "sample_skipped"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    index: Optional[int] = None
    reason: str = ""


@event
@dataclass
class WarningEvent(Record):
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
class Failed(Record):
    KIND: ClassVar[str] = "failed"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    reason: str = "failed"
    exit_code: Optional[int] = None
    traceback: Optional[list] = None
    fatal: bool = False               # a restart would fail the same way: do not retry


@event
@dataclass
class Sentinel(Record):
    """A [job]'s log line matched its `done` or `fail` regex (written by the runner)."""
    KIND: ClassVar[str] = "sentinel"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    match: str = "fail"               # done | fail
    line: str = ""


@event
@dataclass
class StopRequested(Record):
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
class Reopened(Record):
    """`fleet verify --repair` dropped samples of this shard: a DONE shard has work again."""
    KIND: ClassVar[str] = "reopened"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    samples: int = 0
    reason: str = ""


@event
@dataclass
class Checked(Record):
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
class Shipping(Record):
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
class Leased(Record):
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
class LeaseMoved(Record):
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
class Relocated(Record):
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
class Exited(Record):
    """The launch ended: `code` (negative: killed by that signal; None: unknown), `stopped` (the
    runner was told to stop it), `vanished` (written by the agent: the runner died too)."""
    KIND: ClassVar[str] = "exited"
    t: float = field(default_factory=now)
    launch: Optional[int] = None
    code: Optional[int] = None
    pid: Optional[int] = None
    stopped: bool = False
    vanished: bool = False


Event = Record        # any of the above


# Events after which a launch has made progress (the judge's last progress time moves on them).
PROGRESS_EVENTS = (Launch, Loaded, Progress)


def parse_event(d: Any) -> Optional[Record]:
    """A typed event from a JSON object, or None for anything that is not one (a line written by
    a newer worker, a hand edit): the record must never crash the reader."""
    if not isinstance(d, dict):
        return None
    cls = EVENT_TYPES.get(d.get("event"))
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


# --- agent messages (the agent's stdout) --------------------------------------------------------

class Message(Record):
    TAG: ClassVar[str] = "type"


@message
@dataclass
class Hello(Message):
    KIND: ClassVar[str] = "hello"
    protocol: int = PROTOCOL_VERSION
    host: str = ""
    pid: int = 0
    t: float = field(default_factory=now)
    plan: Optional["Plan"] = None      # the run's plan.json on this host (worker/plan.py)
    host_id: Optional[str] = None      # which machine this is (<root>/host-id, written by preflight)

    @classmethod
    def from_dict(cls, d: dict):
        """A hello whose plan is no plan still greets (fleet.follow.hello_plan refuses the plan)."""
        try:
            return super().from_dict(d)
        except ReplyError:
            return super().from_dict({k: v for k, v in d.items() if k != "plan"})


@message
@dataclass
class EventMessage(Message):
    """One event of a shard's record, typed (None: a line that is no event this side knows)."""
    KIND: ClassVar[str] = "event"
    shard: int = 0
    event: Optional[Record] = None

    @classmethod
    def from_dict(cls, d: dict):
        msg = super().from_dict(d)
        msg.event = parse_event(msg.event)
        return msg


@message
@dataclass
class RecordDamage(Message):
    """Bytes of a shard's events.jsonl that are no record (not JSON, or a line that never ends):
    passed over, and told, so a record that lost its tail never reads as whole."""
    KIND: ClassVar[str] = "record_damage"
    shard: int = 0
    bad_bytes: int = 0
    bad_lines: int = 0
    after_line: int = 0


@message
@dataclass
class Liveness(Message):
    """`alive`: the shard's lock is held (its runner or process lives). `acting`: a stop or restart
    is being carried out on the host (`hostctl act` holds the shard's act lock); None where nothing
    acts on the host (an engine's task: the supervisor resubmits). Sent on a change, with `idle_s` while the
    shard is alive (its idle time between changes goes in the host's Idle line)."""
    KIND: ClassVar[str] = "shard"
    shard: int = 0
    alive: bool = False
    pid: Optional[int] = None
    t: float = field(default_factory=now)
    acting: Optional[bool] = None
    idle_s: Optional[float] = None    # seconds since the newest launch last made progress, by the
                                      # host's monotonic clock (a step of its wall clock changes nothing)


@message
@dataclass
class Idle(Message):
    """The idle time of every live shard whose life did not change, in one line a telemetry
    interval (one Liveness each was 8 lines a second per 8-GPU host: at 64 hosts, most of what the
    supervisor read). `shards[i]` has been `idle_s[i]` seconds without progress, by the host's
    monotonic clock. A change of a shard's life is still its own Liveness."""
    KIND: ClassVar[str] = "idle"
    shards: list[int] = field(default_factory=list)
    idle_s: list[float] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict):
        msg = super().from_dict(d)            # (checked inline: _check per element, 64 lines a second)
        if not (isinstance(msg.shards, list) and isinstance(msg.idle_s, list) and len(msg.shards) == len(msg.idle_s)
                and all(type(k) is int for k in msg.shards) and all(type(s) in (int, float) for s in msg.idle_s)):
            raise ReplyError(f"idle: not a list of shards and one of their idle times: {d!r:.120}")
        return msg


@message
@dataclass
class GpuReading(Message):
    KIND: ClassVar[str] = "gpu"
    t: float = field(default_factory=now)
    source: str = "none"               # nvml | nvidia-smi | none
    gpus: list["GpuStat"] = field(default_factory=list)
    error: Optional[str] = None


@message
@dataclass
class DiskReading(Message):
    KIND: ClassVar[str] = "disk"
    t: float = field(default_factory=now)
    path: str = ""
    free: Optional[int] = None
    total: Optional[int] = None
    error: Optional[str] = None


@message
@dataclass
class Beat(Message):
    KIND: ClassVar[str] = "beat"
    t: float = field(default_factory=now)


@message
@dataclass
class Replayed(Message):
    """Every shard's record so far has been sent: the picture is complete from here on."""
    KIND: ClassVar[str] = "replayed"
    t: float = field(default_factory=now)


@message
@dataclass
class TaskState(Message):
    """What the engine says of a shard's newest launch while it lives: `phase` one of TASK_PHASES,
    `state` and `reason` the engine's words (PENDING with Priority; RUNNING on a node). Sent when
    it changes; the end of a task is recorded as an event (TaskEnded), not sent as this."""
    KIND: ClassVar[str] = "task"
    shard: int = 0
    launch: Optional[int] = None
    job: str = ""
    phase: str = "queued"
    state: str = ""
    reason: Optional[str] = None
    node: Optional[str] = None
    t: float = field(default_factory=now)


@message
@dataclass
class EnginePoll(Message):
    """Whether the last question to the engine (its queue, its actors) was answered; `error` is its
    last line, `engine` the engine's name for people."""
    KIND: ClassVar[str] = "engine_poll"
    t: float = field(default_factory=now)
    error: Optional[str] = None
    engine: str = ""


@message
@dataclass
class TaskGpus(Message):
    """The GPUs an engine's task reported from inside its allocation (NVML there), with its node."""
    KIND: ClassVar[str] = "task_gpus"
    shard: int = 0
    launch: Optional[int] = None
    node: Optional[str] = None
    t: float = field(default_factory=now)
    source: str = "none"
    gpus: list["GpuStat"] = field(default_factory=list)
    error: Optional[str] = None


@message
@dataclass
class Claimed(Message):
    """The run is another supervisor's (its agent holds the run's claim on this host): the agent
    says whose and exits, and the supervisor that asked refuses to run beside it (issue 52)."""
    KIND: ClassVar[str] = "claimed"
    holder: Optional["SupervisorClaim"] = None


@message
@dataclass
class End(Message):
    KIND: ClassVar[str] = "end"


@message
@dataclass
class AgentError(Message):
    """The agent hit an error it cannot go on from; `message` is its last line."""
    KIND: ClassVar[str] = "error"
    t: float = field(default_factory=now)
    message: str = ""


# --- actions (supervisor -> `hostctl act`, one JSON object a line on its stdin) -----------------

ACT_LOCK_FILE = "act.lock"   # held by whoever carries out a shard's stop or restart
CLAIM_LOCK_FILE = "supervisor.lock"   # in the run dir: held by the supervising agent (worker/agent.py)
CLAIM_FILE = "supervisor.json"        # beside it: who holds it (SupervisorClaim)


@dataclass
class ShardAction(Record):
    """One thing to do to one shard, carried out on its host by `hostctl act`.

    kind: launch (a shard that is not running) | stop | restart. `expect_launch` is the newest launch
    the caller's verdict was about: a launch or restart is carried out only if the shard's newest
    launch is still that one, so two supervisors acting on the same verdict act once ("stale" for
    the second). A stop is always carried out (it applies to whatever runs). `launch_spec` holds
    what `hostctl launch` takes."""
    TAG: ClassVar[str] = "action"
    KIND: ClassVar[str] = "shard"
    shard: int = 0
    kind: str = "launch"
    why: str = "user"
    by: str = "manual"
    reason: Optional[str] = None
    expect_launch: Optional[int] = None
    grace: float = 10.0
    launch_spec: Optional["LaunchSpec"] = None
    policy: bool = False              # the supervisor's own decision: refused where a user's stop stands


@dataclass(frozen=True)
class SentinelSpec(CompactReply):
    """How a [job]'s runner judges it by its log (worker/sentinels.py): regexes for its done, fail
    and progress lines, output files counted as progress, samples per shard when nothing says."""
    done: Optional[str] = None           # regex: the job finished well
    fail: Optional[str] = None           # regex: the job failed
    progress: Optional[str] = None       # regex with (?P<done>\d+) and optionally (?P<total>\d+)
    progress_glob: Optional[str] = None  # output files counted as progress ({shard} filled in)
    total: Optional[int] = None          # samples per shard when nothing else says


@dataclass
class RowShare(CompactReply):
    """A [job] whose command takes its rows (`{start}`/`{end}`): what its runner needs to hold
    leases of its host's pool instead of one fixed range (worker/ranged.py)."""
    num_rows: int = 0                 # the run's rows: {start}/{end} are global indices within them
    num_shards: int = 1
    pool: Optional[list[int]] = None  # the shards of its host that share their rows (itself alone: None)
    min_chunk: int = 1                # the fewest rows one launch of the command is given


@dataclass
class LaunchSpec(Reply):
    """What `hostctl launch` takes to start a shard's attempt (and an engine's task runs): its command
    line, environment and working folder, its first GPU, a [job]'s sentinels and, for a [job]
    taking its rows, its share of them."""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Optional[str] = None
    gpu: Optional[int] = None
    sentinels: Optional[SentinelSpec] = None
    rows: Optional[RowShare] = None


ACT_STATUSES = ("started", "stopping", "stopped", "restarting", "stale", "busy", "running",
                "not running", "error")


@dataclass
class ActResult(Record):
    """What `hostctl act` did about one action at once. The outcome itself (the launch, the end)
    is read from the shard's record: started / stopping / restarting say only that it is under way."""
    TAG: ClassVar[str] = "result"
    KIND: ClassVar[str] = "act"
    shard: int = 0
    status: str = "error"
    launch: Optional[int] = None      # the shard's newest launch after the action
    detail: Optional[str] = None


def parse_message(line: str, strings: Callable[[Any], Any] = lambda d: d) -> Optional[Message]:
    """A typed message from an agent's line (None for anything else); `strings` maps the decoded
    JSON first (fleet: text.printable_data, so no host's bytes reach a terminal)."""
    try:
        d = strings(json.loads(line))
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    cls = MESSAGE_TYPES.get(d.get("type"))
    if cls is None:
        return None
    try:
        return cls.from_dict(d)
    except (TypeError, ValueError):       # a field of the wrong type (ReplyError is a ValueError)
        return None


# --- JSON lines files --------------------------------------------------------------------------

def append_jsonl(path: str, record: Record | dict, sync: bool = True) -> None:
    """Append one record as a single write, so concurrent appenders never interleave a line. A write
    the disk cut short (full) is taken back and raised as OSError: never a torn line that would
    swallow the next record too."""
    text = record.to_json() if isinstance(record, Record) else json.dumps(record, separators=(",", ":"))
    line = (text + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        before = os.fstat(fd).st_size
        if before and os.pread(fd, 1, before - 1) != b"\n":
            line = b"\n" + line        # after a torn or foreign tail: a record of its own, never glued to it
        written = os.write(fd, line)
        if written != len(line):
            os.ftruncate(fd, before)
            raise OSError(errno.ENOSPC, f"no space left for a record in {path}")
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


class JsonlTail:
    """A JSON-lines file read as it grows, a bounded chunk at a time, each byte once: complete
    records from where the last read stopped. A line that is not a JSON object, and a line that
    runs past MAX_RECORD_BYTES without ending (no writer writes one: garbage, a foreign file),
    count as unreadable (`bad_bytes`, `bad_lines`, the first after `bad_after` good lines) and are
    passed over; a short unended line waits for its end (a writer still writing)."""
    CHUNK = 8 << 20
    MAX_RECORD_BYTES = 1 << 20

    def __init__(self, path: str):
        self.path = path
        self.offset = 0                 # the start of the first line not yet read
        self.skipping = False           # inside an unended line too long to be a record
        self.lines = self.bad_lines = self.bad_bytes = 0
        self.bad_after: int | None = None

    def read(self) -> list[dict]:
        records: list[dict] = []
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return records
        with f:
            while True:
                f.seek(self.offset)
                data = f.read(self.CHUNK)
                end = data.rfind(b"\n")
                if end < 0:
                    if len(data) >= self.MAX_RECORD_BYTES or (self.skipping and data):
                        self._bad(len(data), line=not self.skipping)
                        self.offset, self.skipping = self.offset + len(data), True
                        continue
                    return records
                for raw in data[:end + 1].split(b"\n")[:-1]:
                    self._take(raw, records)
                self.offset += end + 1
                if len(data) < self.CHUNK and len(data) - end - 1 < self.MAX_RECORD_BYTES:
                    return records

    def _take(self, raw: bytes, records: list[dict]) -> None:
        if self.skipping:                       # the end of a line already counted unreadable
            self.skipping = False
            self._bad(len(raw) + 1, line=False)
            return
        try:
            rec = json.loads(raw) if raw.strip() else None
        except ValueError:
            rec = False
        if isinstance(rec, dict):
            self.lines += 1
            records.append(rec)
        elif rec is not None:
            self._bad(len(raw) + 1)

    def _bad(self, n: int, line: bool = True) -> None:
        if self.bad_after is None:
            self.bad_after = self.lines
        self.bad_bytes += n
        self.bad_lines += line


def iter_jsonl(path: str) -> Iterator[dict]:
    """Every complete record of a JSON-lines file (its unreadable lines passed over)."""
    yield from JsonlTail(path).read()


def read_events(path: str) -> list[Record]:
    """Every typed event of a shard's record, in order."""
    return [e for e in map(parse_event, iter_jsonl(path)) if e is not None]


# --- replies: what a host command prints, one JSON object, the last line of its stdout ----------
#
# Written by the host side through these classes (`to_dict`) and parsed once where they arrive in
# fleet (`from_dict`, through fleet.deploy.run_worker_module's `reply=`): a reply that is not one
# of these is an error naming the host there, never a KeyError later. Every field has a default,
# so a reply from an older or newer worker still parses; unknown keys are dropped.

@dataclass
class Status(Reply):
    """What a host command that only does one thing did (`hostctl reopen`: reopened | running;
    `worker.relocate`: adopted | already | revoked | error, with `detail`)."""
    status: str = ""
    detail: str = ""


@dataclass
class SupervisorClaim(CompactReply):
    """Who supervises the run: written by its agent into `<run dir>/supervisor.json` while it holds
    the run's claim (`supervisor.lock`), and handed to an agent of another supervisor as the
    reason it refuses (`Claimed`)."""
    id: str = ""                # machine:pid:start of the supervisor
    run: str = ""
    machine: str = ""
    user: str = ""
    pid: int = 0
    started: float = 0.0
    config: str = ""            # its fleet.toml, on its machine
    socket: str = ""            # its control socket, on its machine
    agent_pid: Optional[int] = None


@dataclass
class Unfinished(Reply):
    """`worker.relocate pending`: the rows of a host's pool not yet done (held, free, less every
    row a manifest there records), which a host whose every GPU has given up gives to the others."""
    runs: list[list[int]] = field(default_factory=list)
    error: Optional[str] = None


@dataclass
class GpuStat(CompactReply):
    """One GPU as telemetry read it (worker/gpu.py); None where a reading is not available."""
    index: int = 0
    name: Optional[str] = None
    uuid: Optional[str] = None
    mem_used: Optional[int] = None     # bytes
    mem_total: Optional[int] = None
    util: Optional[float] = None       # percent
    temp: Optional[float] = None       # degrees C
    power_w: Optional[float] = None
    power_limit_w: Optional[float] = None
    lost: Optional[bool] = None        # NVML lost it: listed, with no readings


@dataclass
class ModelIdentity(CompactReply):
    """What a model folder is (worker.identity.model_identity): hashes of its config and of its
    weight files' names, sizes and edges; `path` is recorded, never compared."""
    config: str = ""
    weights: str = ""
    path: Optional[str] = None


@dataclass
class DataIdentity(CompactReply):
    """What a dataset is (worker.identity.dataset_identity): its rows, bytes, edge rows' and
    content's hashes; `path` and `mtime` are recorded, never compared."""
    rows: int = 0
    bytes: int = 0
    first_row: str = ""
    last_row: str = ""
    content: Optional[str] = None      # absent from plans written before it was recorded
    path: Optional[str] = None
    mtime: Optional[float] = None


@dataclass
class WorkIdentity(CompactReply):
    """The identity of a run's work (worker.identity.work_identity): its model, its data and what
    is written. Kept in plan.json and meta.json and compared key by key (identity.differences):
    what an older record lacks is not compared."""
    model: Optional[ModelIdentity] = None
    data: Optional[DataIdentity] = None
    layer_ids: Optional[list[int]] = None
    last_layer_norm: Optional[str] = None
    target_last: Optional[bool] = None
    format: Optional[str] = None
    loss_mask: Optional[str] = None
    dtype: Optional[str] = None


@dataclass
class Check(Reply):
    """One finding of a host check: level error (refuses the host) | warning."""
    level: str = "error"
    message: str = ""


@dataclass
class PlanShard(Reply):
    id: int = 0
    host: str = ""
    gpu: int = 0
    gpus: list[int] = field(default_factory=list)


@dataclass
class Plan(Reply):
    """The run's plan (`<root>/<run>/plan.json`, worker/plan.py; made by fleet/plan.py): the shard
    layout, the fleet.toml values the work depends on (`spec`), the identity of the work
    (worker.identity), each host name's machine (`host_ids`), `launcher` the engine that queues its tasks, or None."""
    version: int = 0
    run: str = ""
    created: float = 0.0
    num_shards: int = 0
    shards: list[PlanShard] = field(default_factory=list)
    spec: dict = field(default_factory=dict)
    identity: WorkIdentity = field(default_factory=WorkIdentity)
    host_ids: dict[str, str] = field(default_factory=dict)
    launcher: Optional[str] = None


@dataclass
class Footprint(Reply):
    """The output's projected size (worker.preflight.footprint): the whole run's, and what is still
    to write in row buckets [edges[j], edges[j+1]) (fleet/footprint.py sums a host's shards')."""
    rows: int = 0
    tokens: int = 0
    exact: bool = False
    basis: str = ""
    dtype: str = "bf16"
    layers: int = 0
    hidden_size: int = 0
    bytes_per_token: int = 0
    bytes_per_file: int = 0
    total_bytes: int = 0
    written_bytes: int = 0
    edges: list[int] = field(default_factory=list)
    remaining: list[int] = field(default_factory=list)
    bytes_per_token_fp8: Optional[int] = None    # what dtype = "fp8" would take (bf16 speculators)


@dataclass
class EngineCheck(Reply):
    """`python -m worker.engine.<name> check` on the engine's login node."""
    checks: list[Check] = field(default_factory=list)
    version: Optional[str] = None                # the engine's, as it says it
    accounting: Optional[bool] = None            # whether it keeps ended tasks' final states


@dataclass
class PreflightReport(Reply):
    """`python -m worker.preflight`: what a host has and whether it can run its shards."""
    python: str = ""
    checks: list[Check] = field(default_factory=list)
    telemetry: str = "none"                      # nvml | nvidia-smi | none
    torch: Optional[str] = None
    cuda_devices: Optional[int] = None
    gpu_count: int = 0
    gpus: list[int] = field(default_factory=list)   # the GPU indices its shards will use
    gpu_uuids: list[str] = field(default_factory=list)   # theirs, where telemetry reads them (which card)
    plan: Optional[Plan] = None                  # the run's plan on this host, if it has one
    host_id: Optional[str] = None                # which machine this is (<root>/host-id)
    identity: WorkIdentity = field(default_factory=WorkIdentity)   # what its model and data are
    free_bytes: Optional[int] = None             # free at the output
    folder_id: Optional[str] = None              # the output folder's id (its meta.json)
    footprint: Optional[Footprint] = None
    estimated_bytes: Optional[int] = None        # still to write for the whole run
    uplink_bps: Optional[float] = None           # measured upload to the run's destination
    write_bps: Optional[float] = None            # measured write rate of the output disks (worker.probe)
    engine: Optional[EngineCheck] = None         # an engine's check of its login node (fleet adds it)

    @property
    def errors(self) -> list[str]:
        return [c.message for c in self.checks if c.level == "error"]

    @property
    def warnings(self) -> list[str]:
        return [c.message for c in self.checks if c.level != "error"]


@dataclass
class Repair(Reply):
    """What `worker.verify --repair` did to a folder."""
    dropped: list[int] = field(default_factory=list)
    deduplicated: list[int] = field(default_factory=list)
    removed_files: int = 0
    retried_skips: list[int] = field(default_factory=list)
    moved_away: list[int] = field(default_factory=list)   # copies of rows another host holds now
    restored: list[int] = field(default_factory=list)     # rows given to a host that never took them: back
    reshipped: list[int] = field(default_factory=list)    # whole here, wrong or missing at the destination:
                                                          # the next launch ships them again


@dataclass
class VerifyReport(Reply):
    """`python -m worker.verify`: one output folder checked. `written`: half-open runs of indices
    (worker.ranges); `skipped`: index (as a string, JSON's keys) -> reason."""
    num_samples: Optional[int] = None
    format: Optional[str] = None
    dtype: Optional[str] = None
    checked: int = 0
    folder_id: Optional[str] = None
    repaired: Optional[Repair] = None
    written: list[list[int]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    unrecorded_files: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    command: Optional[str] = None                # the command that trains on the folder
    away: dict[str, list[list[int]]] = field(default_factory=dict)   # host -> runs here its ledger says moved there
    broken: list[list[int]] = field(default_factory=list)            # runs of rows whose file here is wrong
    strays: list[list[int]] = field(default_factory=list)            # files no manifest records, of moved rows
    owner: Optional[str] = None                  # the run its owner record (.fleet/owner.json) names
    checked_rows: int = 0                        # rows re-computed by the reference forward (worker/reference.py)
    layer_ids: list[int] = field(default_factory=list)
    worst_cosine: list[float] = field(default_factory=list)   # per saved layer, over those rows


@dataclass
class ExportSummary(Reply):
    """`python -m worker.export`: what one host's export did."""
    source: str = ""
    out: str = ""
    format: str = ""
    dtype: str = ""
    to_do: int = 0
    written: int = 0
    skipped: int = 0
    problems: list[str] = field(default_factory=list)


@dataclass
class Submission(Reply):
    """`python -m worker.engine.<name> submit`: status submitted | held (every shard still live) | error;
    `shards`: shard -> submitted | refused (recorded as failed) | held (its task is live)."""
    status: str = "error"
    job: Optional[str] = None
    argv: Optional[str] = None
    error: Optional[str] = None
    shards: dict[str, str] = field(default_factory=dict)


@dataclass
class Cancellation(Reply):
    """`python -m worker.engine.<name> cancel` (one shard: `status` not running | stopped | cancelling |
    error) and `cancel-all` (`shards`: shard -> not running | stopped | cancelling)."""
    status: str = "error"
    job: Optional[str] = None
    state: Optional[str] = None                  # the engine's state of the task at the end
    error: Optional[str] = None
    shards: dict[str, str] = field(default_factory=dict)
