"""What the live view reads and asks for, behind one small interface (Harlequin's adapter idea).

`SupervisorSource` drives a Supervisor in this process (the run's supervisor serves its clients
through one: fleet/service.py); `fleet.client.RemoteSource` is the same interface over the
supervisor's control socket, which is what `fleet up` opens the view on; the benchmark's synthetic
512-shard fleet and the visual tests' fixed snapshots feed the same screen. The view never talks
SSH itself and never builds a path or a command: the source does.
"""

from __future__ import annotations

import time
from collections import deque
from typing import AsyncIterator, Callable, Protocol

from .actions import describe
from .judge import throughput_history
from .schema import FleetSnapshot
from .store import Transition
from .supervisor import Supervisor
from .transport import HostError


class FleetSource(Protocol):
    messages: deque                       # the supervisor's newest log lines (the log pane's title)

    def snapshot(self) -> FleetSnapshot: ...

    async def history(self, step: float, points: int) -> list[tuple[float, float, float]]:
        """(time, tokens/s, samples/s) per interval up to now, rebuilt from the records."""

    def refusal(self, shard_id: int, kind: str) -> str | None:
        """Why `kind` (restart | stop) cannot apply to this shard now; None if it can."""

    async def restart(self, shard_ids: list[int]) -> list[str]: ...

    async def stop(self, shard_ids: list[int]) -> list[str]: ...

    async def stop_all(self) -> list[str]: ...

    def follow_log(self, shard_id: int) -> AsyncIterator[str]: ...

    def subscribe(self, listener: Callable[[list[Transition]], None]) -> None:
        """`listener` gets the shards' transitions as they are published (optional)."""


class SupervisorSource:
    def __init__(self, sup: Supervisor, on_log: Callable[[str], None] | None = None):
        self.sup = sup
        self.launch_task = None
        self.messages: deque[str] = deque(maxlen=50)   # the supervisor's log lines, for the screen
        more = on_log or (lambda line: None)

        def told(line: str) -> None:
            self.messages.append(line)
            more(line)
        sup.on_log = told

    async def close(self) -> None:
        """Stop following; the workers keep running."""
        await self.sup.close()

    def snapshot(self) -> FleetSnapshot:
        return self.sup.snapshot()

    def subscribe(self, listener: Callable[[list[Transition]], None]) -> None:
        self.sup.subscribe(listener)

    def history_now(self, step: float, points: int) -> list[tuple[float, float, float]]:
        offsets = {name: host.clock_offset for name, host in self.sup.store.hosts.items()}
        records = [(s.record, offsets[s.placement.host]) for s in self.sup.shards.values()]
        return throughput_history(records, time.time(), step, points)

    async def history(self, step: float, points: int) -> list[tuple[float, float, float]]:
        return self.history_now(step, points)

    def refusal(self, shard_id: int, kind: str) -> str | None:
        """The one rule for what may be done to a shard (the same as `fleet restart`'s)."""
        return self.sup.refusal(shard_id, kind)

    async def restart(self, shard_ids: list[int]) -> list[str]:
        return [describe(r) for r in (await self.sup.request(shard_ids, "restart")).values()]

    async def stop(self, shard_ids: list[int]) -> list[str]:
        return [describe(r) for r in (await self.sup.request(shard_ids, "stop")).values()]

    async def stop_all(self) -> list[str]:
        return [r.text() for r in await self.sup.stop_all()]

    async def follow_log(self, shard_id: int) -> AsyncIterator[str]:
        """The shard's log tail, then new lines; raises HostError when the stream drops (the
        view says so and follows again)."""
        async for line in self.sup.log_lines(shard_id):
            yield line
        raise HostError(f"shard {shard_id}: log stream ended")
