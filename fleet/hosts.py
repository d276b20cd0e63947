"""What the supervisor knows of a host, below the store and the snapshot that both read it: its
reachability, clock, readings and how far behind its lines we are (`Host`)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from worker import protocol

from .schema import Disk, Gpu
from .transport import HostError, HostUnusable

CATCH_UP_S = 5.0          # a line read this long after it was written: we are behind that host
OFFSET_WINDOW_S = 60.0    # the clock offset is the best of this many seconds of lines


@dataclass
class Host:
    """What the supervisor knows of a host from its agent (with an engine of tasks: its login node, or a
    compute node its tasks report from)."""
    name: str
    address: str
    reachable: bool | None = None          # None: not tried yet
    error: str | None = None
    telemetry: str | None = None
    gpus: list[Gpu] = field(default_factory=list)
    gpu_t: float | None = None             # host clock of the last GPU reading
    disk: Disk | None = None
    clock_offset: float = 0.0              # host clock - supervisor clock
    last_seen: float | None = None         # supervisor clock
    replayed: bool = False
    role: str | None = None                # with an engine of tasks: "login" or "node"
    usd_per_hour: float | None = None      # [[hosts]] usd_per_hour
    unusable: bool = False                 # reached, but its python or agent fails there
    down_since: float | None = None        # supervisor clock: unreachable since (None: reachable)
    offsets: deque = field(default_factory=deque)   # (supervisor time, host clock - it): the window's candidates
                                                    # for its maximum, decreasing (every line's, once O(n) a line)
    behind_s: float = 0.0                  # how old the newest line read was when read (a backlog)
    stale: bool = False                    # our loop ran late: nothing read on time since
    removed: bool = False                  # the plan has shards here; fleet.toml no longer lists it

    @classmethod
    def removed_from_config(cls, name: str) -> Host:
        """A host of the run's plan that fleet.toml no longer lists: never reached again, lost
        from the start (its unfinished rows go to the others)."""
        return cls(name, "-", reachable=False, removed=True, down_since=0.0,
                   error="no longer in fleet.toml: its rows go to the other hosts")

    def host_now(self, now: float) -> float:
        return now + self.clock_offset

    def heard(self, t: float | None, now: float) -> None:
        """A line came from the agent (`t`: its host-clock stamp, if any). The clock offset is the
        largest `t - now` of the last minute (a line read late, from a backlog, says less), and a
        line stamped more than CATCH_UP_S before the host's now is one we read behind: the host is
        being caught up with, and nothing is decided for its shards until a line is read on time."""
        self.last_seen = now
        if t is None:
            return
        offset = float(t) - now          # a sliding-window maximum: offsets[0] is the window's largest
        while self.offsets and self.offsets[-1][1] <= offset:
            self.offsets.pop()           # (never the maximum again while this one is in the window)
        self.offsets.append((now, offset))
        while self.offsets[0][0] < now - OFFSET_WINDOW_S:
            self.offsets.popleft()
        self.clock_offset = self.offsets[0][1]
        self.behind_s = max(0.0, now + self.clock_offset - float(t))
        if self.behind_s <= CATCH_UP_S:
            self.behind_s, self.stale = 0.0, False

    def fell_behind(self) -> None:
        """Our own loop ran late (the process was stopped or starved): what we know of this host is
        old until a line is read on time."""
        self.stale = True

    @property
    def down_reason(self) -> str | None:
        """Why the host cannot be read now (its shards are UNKNOWN for it), or None."""
        if self.reachable is not False:
            return None
        return f"host {'unusable' if self.unusable else 'unreachable'}: {self.error}"

    @property
    def catching_up(self) -> bool:
        return self.stale or self.behind_s > CATCH_UP_S

    def trying(self) -> None:
        """Not known yet: being reached again (a deploy)."""
        self.reachable = None

    def up(self) -> None:
        self.reachable, self.error, self.unusable, self.down_since = True, None, False, None

    def down(self, e: HostError, now: float | None = None) -> None:
        """The host cannot be read: unreachable, or reached but unusable (its python, its agent)."""
        self.reachable, self.error = False, str(e).removeprefix(f"{self.name}: ")
        self.unusable = isinstance(e, HostUnusable)
        self.replayed = False
        if self.down_since is None:
            self.down_since = time.time() if now is None else now

    def lost(self, now: float, after: float | None) -> bool:
        """Unreachable, or reached but unable to run the worker (a preflight refused when it came
        back, its python gone), for `after` seconds: its rows go to the others."""
        return after is not None and self.reachable is False and \
            self.down_since is not None and now - self.down_since >= after

    def replay_starts(self) -> None:
        self.replayed = False

    def replay_done(self) -> None:
        self.replayed = True

    def engine_said(self, msg: protocol.EnginePoll) -> None:
        self.error = f"{msg.engine or 'the engine'}: {msg.error}" if msg.error else None

    def read_gpus(self, msg: protocol.GpuReading) -> None:
        self.telemetry, self.gpus, self.gpu_t = msg.source, [Gpu(**g.to_dict()) for g in msg.gpus], msg.t

    def read_disk(self, msg: protocol.DiskReading) -> None:
        self.disk = Disk(path=msg.path, free=msg.free, total=msg.total, error=msg.error)
