"""What the TUI reads and asks for, behind one small interface (Harlequin's adapter idea).

`SupervisorSource` drives a live Supervisor; anything else with the same methods (the benchmark's
synthetic 512-shard fleet, a fixed snapshot for visual tests) can feed the same screen. The TUI
never talks SSH itself.
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from ..jobs import shard_dir
from ..snapshot import FleetSnapshot
from ..supervisor import Supervisor
from ..transport import HostError


class FleetSource(Protocol):
    def snapshot(self) -> FleetSnapshot: ...

    async def restart(self, shard_ids: list[int]) -> list[str]: ...

    async def stop(self, shard_ids: list[int]) -> list[str]: ...

    async def stop_all(self) -> list[str]: ...

    def follow_log(self, shard_id: int) -> AsyncIterator[str]: ...


class SupervisorSource:
    def __init__(self, sup: Supervisor):
        self.sup = sup
        self.launch_task = None

    async def close(self) -> None:
        """Stop following; the workers keep running."""
        await self.sup.close()

    def snapshot(self) -> FleetSnapshot:
        return self.sup.snapshot()

    async def restart(self, shard_ids: list[int]) -> list[str]:
        out = []
        for k in shard_ids:
            r = await self.sup.relaunch(k, by="manual")
            out.append(f"shard {k}: {r.get('status')}" + (f" ({r['error']})" if r.get("error") else ""))
        return out

    async def stop(self, shard_ids: list[int]) -> list[str]:
        out = []
        for k in shard_ids:
            r = await self.sup.stop(k)
            out.append(f"shard {k}: {r.get('status')}" + (f" ({r['error']})" if r.get("error") else ""))
        return out

    async def stop_all(self) -> list[str]:
        results = await self.sup.stop_all()
        return [f"{host}: {r.get('error') or ', '.join(f'{k} {v}' for k, v in r.items()) or 'nothing running'}"
                for host, r in results.items()]

    async def follow_log(self, shard_id: int) -> AsyncIterator[str]:
        """The shard's log tail, then new lines; raises HostError when the stream drops."""
        host = self.sup.shards[shard_id].placement.host
        link = self.sup.links[host]
        path = f"{shard_dir(self.sup.config, link.spec, shard_id)}/log"
        stream = await link.transport.stream(["tail", "-n", "200", "-F", path])
        try:
            async for line in stream.lines():
                yield line.rstrip("\n")
        finally:
            await stream.close()
        raise HostError(f"{host}: log stream ended")
