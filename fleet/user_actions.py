"""What a person asks of the run's shards — a restart or a stop (the view's keys, `fleet restart`),
a launch of every shard that is neither live nor done (`fleet up`), a stop of the whole run
(`fleet down`, D) — refused by the one rule (`fleet.actions`) on the verdict the screen shows,
and carried out as the decide pass's actions are (`fleet.carrier`), one command per host.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

from worker import protocol

from .actions import HostStop, busy_mark, refusal as action_refusal, user_action
from .carrier import Carrier
from .config import Config
from .follow import HostLink
from .judge import Verdict
from .state import LIVE, State
from .store import Shard, Store
from .transport import HostError


class UserActions:
    """The user's restarts, stops and launches, after the one rule, through the carrier."""

    def __init__(self, config: Config, store: Store, links: dict[str, HostLink], carrier: Carrier,
                 verdict: Callable[[Shard], Verdict], read_once: Callable[[], Awaitable[object]],
                 wait_replayed: Callable[[], Awaitable[None]]):
        """`verdict`: the one the screen shows; `read_once`: every host's record, for a one-shot
        command with no plan; `wait_replayed`: until every host has replayed (or is down)."""
        self.config, self.store, self.links, self.carrier = config, store, links, carrier
        self.verdict, self.read_once, self.wait_replayed = verdict, read_once, wait_replayed
        self.grace = config.spec.supervise.stop_grace

    def refusal(self, shard_id: int, kind: str) -> str | None:
        """Why this action cannot apply to this shard now (the same rule for every caller)."""
        s = self.store.shards.get(shard_id)
        if s is None:
            return f"no shard {shard_id}"
        v = self.verdict(s)                         # the decision the screen shows
        return action_refusal(kind, v.state, shard_id, verifiable=self.config.spec.job is None, why=v.reason)

    async def request(self, shard_ids: list[int], kind: str,
                      wait: float = 0.0) -> dict[int, protocol.ActResult]:
        """The user's restart or stop of these shards: refused by the one rule (status "refused"),
        else carried out through the launcher, one command per host (`wait`: until each stop or
        restart is done on the host)."""
        out: dict[int, protocol.ActResult] = {}
        by_host: dict[str, list[protocol.ShardAction]] = {}
        for k in shard_ids:
            why = self.refusal(k, kind)
            if why is not None:
                out[k] = protocol.ActResult(shard=k, status="refused", detail=why)
                continue
            s = self.store.shards[k]
            s.begin(time.time(), busy_mark(s.record))
            by_host.setdefault(s.placement.host, []).append(user_action(s.record, kind, self.grace, k))
        results = await asyncio.gather(*(self.carrier.carry_out(self.links[h], acts, wait)
                                         for h, acts in by_host.items()))
        for batch in results:
            out.update((r.shard, r) for r in batch)
        return dict(sorted(out.items()))

    async def launch_all(self) -> None:
        """Launch every shard that is neither live nor done (what `fleet up` does on (re)attach):
        a manual launch, so failed, FATAL and stopped shards start over with a fresh budget; one
        command per host (an engine of tasks: one submission of all of them)."""
        await self.wait_replayed()
        due: dict[str, list[protocol.ShardAction]] = {}
        for s in self.store.shards.values():
            if self.store.hosts[s.placement.host].reachable and s.busy_since is None and not s.alive and \
                    not self.store.moves.untold(s.placement.host) and \
                    self.verdict(s).state not in LIVE | {State.DONE, State.QUEUED}:
                s.begin(time.time(), busy_mark(s.record))
                due.setdefault(s.placement.host, []).append(user_action(s.record, "restart", self.grace, s.id))
        await asyncio.gather(*(self.carrier.carry_out(self.links[h], acts) for h, acts in due.items()))

    async def stop_all(self, timeout: float | None = None) -> list[HostStop]:
        """`fleet down` / D: a run stop of every shard on every host, whatever its state (a shard
        waiting for a restart, or never launched, is STOPPED too); waits for each to be carried out.
        Returns each host's part: its shards' outcomes, or why it could not be reached."""
        grace = self.grace if timeout is None else timeout
        if not self.store.shards:                # a one-shot command: the plan's shards, or the records'
            await self.read_once()
        return list(await asyncio.gather(*(self._stop_host(link, grace) for link in self.links.values())))

    async def _stop_host(self, link: HostLink, grace: float) -> HostStop:
        try:
            await link.transport.connect()
        except HostError as e:
            return HostStop(link.name, error=str(e))
        ids = [p.shard for p in self.store.on(link.name)]
        if not ids:
            return HostStop(link.name)
        actions = [protocol.ShardAction(shard=k, kind="stop", why="run", grace=grace) for k in ids]
        results = await self.carrier.carry_out(link, actions, wait=grace + 30)
        if results and all(r.status == "error" for r in results):
            return HostStop(link.name, error=results[0].detail or "error")
        return HostStop(link.name, {r.shard: (r.detail or r.status) for r in results})
