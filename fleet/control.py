"""What a client and the run's supervisor say to each other over its control socket: typed records,
one JSON object a line (pydantic models; a line that is not one is an error, never a crash).

A client sends requests, each with an `id`; the supervisor answers each with a `Reply` (or, for a
shard's log, `LogLine`s ending in a `Reply`) carrying that id. A client that sent `watch` also
gets, unasked and in order: `Say` (what setup prints: the deploy's steps, the preflight table),
`Note` (the supervisor's log lines), `Snap` (the newest picture, about every second; a slow client
gets only the newest), `Changes` (the shards' transitions of one decide pass, each with its line),
and `Failed` when setup refused the run. Nothing here does I/O: fleet/service.py serves these,
fleet/client.py sends them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, Field, TypeAdapter, ValidationError

from worker import protocol

from .schema import FleetSnapshot
from .state import State
from .store import Transition

PROTOCOL = 1
PHASES = ("setup", "supervising", "ended", "failed", "stopping")


class Request(BaseModel):
    id: int = 0


class Hello(Request):
    """Who asks (`client`: up, status, down, ...), and what it would run: its fleet.toml's digest
    and its worker bundle, so a supervisor started by another fleet.toml or fleet says so."""
    op: Literal["hello"] = "hello"
    client: str = "?"
    protocol: int = PROTOCOL
    config_digest: str = ""
    bundle: str = ""


class Watch(Request):
    op: Literal["watch"] = "watch"


class SnapshotRequest(Request):
    op: Literal["snapshot"] = "snapshot"


class HistoryRequest(Request):
    op: Literal["history"] = "history"
    step: float
    points: int


class Act(Request):
    """The user's restart or stop of shards, named as the user wrote them ('3', 'box1:2')."""
    op: Literal["act"] = "act"
    kind: Literal["restart", "stop"]
    shards: list[str]
    wait: float = 0.0


class StopAll(Request):
    op: Literal["stop_all"] = "stop_all"
    timeout: Optional[float] = None


class Up(Request):
    """What `fleet up` asks of a supervisor it joins: launch every shard that is neither live nor done."""
    op: Literal["up"] = "up"


class Log(Request):
    op: Literal["log"] = "log"
    shard: str
    last: int = 200
    follow: bool = True


class Metrics(Request):
    op: Literal["metrics"] = "metrics"
    address: str


class Shutdown(Request):
    """Stop supervising (the workers keep running)."""
    op: Literal["shutdown"] = "shutdown"


AnyRequest = Annotated[Union[Hello, Watch, SnapshotRequest, HistoryRequest, Act, StopAll, Up, Log, Metrics,
                             Shutdown], Field(discriminator="op")]


# --- what the supervisor sends -----------------------------------------------------------------

class Welcome(BaseModel):
    type: Literal["welcome"] = "welcome"
    id: int = 0
    protocol: int = PROTOCOL
    run: str
    phase: str
    pid: int
    machine: str
    user: str
    started: float
    config: str
    config_digest: str
    bundle: str
    log: str
    metrics: Optional[str] = None


class Say(BaseModel):
    type: Literal["say"] = "say"
    text: str
    err: bool = True


class Note(BaseModel):
    """A line of the supervisor's log; `past`: one of its last lines, sent to a client as it joins."""
    type: Literal["note"] = "note"
    text: str
    past: bool = False


class Snap(BaseModel):
    """The picture now; `ended`: the run has settled or finished, nothing in flight and every
    host back from being lost told of its rows (the supervisor goes once its clients have read it)."""
    type: Literal["snapshot"] = "snapshot"
    id: int = 0
    phase: str
    ended: bool = False
    snapshot: FleetSnapshot


class TransitionRecord(BaseModel):
    shard: int
    before: Optional[State] = None
    after: State
    failed: bool = False
    t: float

    @classmethod
    def of(cls, t: Transition) -> TransitionRecord:
        return cls(shard=t.shard, before=t.before, after=t.after, failed=t.failed, t=t.t)

    def transition(self) -> Transition:
        return Transition(self.shard, self.before, self.after, self.failed, self.t)


class Changes(BaseModel):
    type: Literal["changes"] = "changes"
    transitions: list[TransitionRecord]
    lines: list[str]


class Failed(BaseModel):
    """Setup refused the run (a preflight refusal, a plan that disagrees): the one line and the exit code."""
    type: Literal["failed"] = "failed"
    message: str
    code: int


class LogLine(BaseModel):
    type: Literal["line"] = "line"
    id: int
    text: str


class ActOutcome(BaseModel):
    shard: int
    status: str
    launch: Optional[int] = None
    detail: Optional[str] = None

    @classmethod
    def of(cls, r: protocol.ActResult) -> ActOutcome:
        return cls(shard=r.shard, status=r.status, launch=r.launch, detail=r.detail)

    def result(self) -> protocol.ActResult:
        return protocol.ActResult(shard=self.shard, status=self.status, launch=self.launch, detail=self.detail)


class HostStopRecord(BaseModel):
    host: str
    shards: dict[int, str] = {}
    error: Optional[str] = None


class Reply(BaseModel):
    """The answer to request `id`: `error` (with the exit code a command gives it) or the data."""
    type: Literal["reply"] = "reply"
    id: int
    error: Optional[str] = None
    code: int = 0
    acted: list[ActOutcome] = []
    stopped: list[HostStopRecord] = []
    history: list[tuple[float, float, float]] = []
    data: Any = None


AnyMessage = Annotated[Union[Welcome, Say, Note, Snap, Changes, Failed, LogLine, Reply], Field(discriminator="type")]

_requests: TypeAdapter = TypeAdapter(AnyRequest)
_messages: TypeAdapter = TypeAdapter(AnyMessage)


class ControlError(ValueError):
    """A line that is not a record of this protocol."""


def encode(record: BaseModel) -> bytes:
    return record.model_dump_json(exclude_defaults=False).encode() + b"\n"


def parse_request(line: bytes) -> Request:
    try:
        return _requests.validate_json(line)
    except ValidationError as e:
        raise ControlError(_first(e)) from None


def parse_message(line: bytes) -> BaseModel:
    try:
        return _messages.validate_json(line)
    except ValidationError as e:
        raise ControlError(_first(e)) from None


def _first(e: ValidationError) -> str:
    err = e.errors()[0] if e.errors() else {"msg": str(e), "loc": ()}
    return f"{'.'.join(map(str, err.get('loc', ())))}: {err.get('msg')}"
