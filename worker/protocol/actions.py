"""The supervisor's actions on a shard and their results: one JSON object a line on `hostctl act`'s
stdin (ShardAction), one back per action (ActResult), and what a launch carries to the host
(LaunchSpec, with a [job]'s SentinelSpec and RowShare), read there by field."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

from .records import CompactReply, Record, Reply


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
