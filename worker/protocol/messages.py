"""The agent's messages: its stdout, one JSON object a line, tagged by ``type``, which fleet's
follower parses as they come (parse_message): Hello (first, with PROTOCOL_VERSION), EventMessage,
Liveness, GpuReading, DiskReading, Beat, Replayed, End, AgentError; under an engine that queues
tasks also TaskState (what the engine says of a live task now), EnginePoll (whether the engine
answered) and TaskGpus (the GPUs a task reported from inside its allocation). Engines translate
their own words into these where they enter (worker/engine/): no record names an engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

from .events import Event, parse_event
from .layout import PROTOCOL_VERSION
from .records import MESSAGE_TYPES, Record, ReplyError, message, now
from .replies import GpuStat, Plan, SupervisorClaim


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
    plan: Optional[Plan] = None      # the run's plan.json on this host (worker/plan.py)
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
    event: Optional[Event] = None

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
    gpus: list[GpuStat] = field(default_factory=list)
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
    gpus: list[GpuStat] = field(default_factory=list)
    error: Optional[str] = None


@message
@dataclass
class Claimed(Message):
    """The run is another supervisor's (its agent holds the run's claim on this host): the agent
    says whose and exits, and the supervisor that asked refuses to run beside it (issue 52)."""
    KIND: ClassVar[str] = "claimed"
    holder: Optional[SupervisorClaim] = None


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


def parse_message(line: str, strings: Callable[[Any], Any] = lambda d: d) -> Optional[Message]:
    """A typed message from an agent's line (None for anything else); `strings` maps the decoded
    JSON first (fleet: text.printable_data, so no host's bytes reach a terminal)."""
    try:
        d = strings(json.loads(line))
    except ValueError:
        return None
    if not isinstance(d, dict):
        return None
    cls = MESSAGE_TYPES.get(d.get("type", ""))
    if cls is None:
        return None
    try:
        return cls.from_dict(d)
    except (TypeError, ValueError):       # a field of the wrong type (ReplyError is a ValueError)
        return None
