"""Actions carried to a host: one command to the engine's Launcher for all of a host's actions, and
what came of them told in the supervisor's log, one line per outcome. Every launch, stop and
restart — the decide pass's, the user's, `fleet down`'s — goes through `Carrier.carry_out`, so a
host that could not be asked is counted the same way whoever asked.
"""

from __future__ import annotations

import time
from typing import Callable

from worker import protocol

from .actions import UNDER_WAY
from .engine import Launcher
from .follow import HostLink
from .judge import LaunchFailure
from .store import Store
from .transport import HostError, HostUnusable


class Carrier:
    """Sends a host's actions to the Launcher and settles the shards whose action came to nothing."""

    def __init__(self, store: Store, launcher: Launcher, say: Callable[[str], None], changed: Callable[[], None]):
        self.store, self.launcher, self.say, self.changed = store, launcher, say, changed

    async def carry_out(self, link: HostLink, actions: list[protocol.ShardAction],
                        wait: float = 0.0) -> list[protocol.ActResult]:
        """Send actions to one host's launcher. A command that could not run there is a failed
        launch for every launch or restart in it (counted by the judge); a command that timed out
        says nothing: the record does, and the verdict decides again."""
        places = {p.shard: p for p in self.store.on(link.name)}
        try:
            results = await self.launcher.act(link.transport, link.spec, actions, places, self.store.num_shards, wait)
        except HostError as e:
            return self._not_carried(link, actions, e)
        for r in results:
            if (s := self.store.shards.get(r.shard)) is not None and r.status not in UNDER_WAY:
                s.done_acting()              # nothing was done (stale, busy, refused): judge again
        self._tell(actions, results)
        return results

    def _not_carried(self, link: HostLink, actions: list[protocol.ShardAction],
                     e: HostError) -> list[protocol.ActResult]:
        """The host could not be asked: unusable, a failed launch; else not known (the record says)."""
        why = str(e).removeprefix(f"{link.name}: ")
        for a in actions:
            s = self.store.shards[a.shard]
            if isinstance(e, HostUnusable) and a.kind != "stop":
                s.launch_failed(LaunchFailure(link.host.host_now(time.time()), a.by, why))
            else:
                s.done_acting()
        told = "failed" if isinstance(e, HostUnusable) else "not confirmed (the host's record will say)"
        self.say(f"shards {ids_text([a.shard for a in actions])}: {actions[0].kind} {told}: {why}")
        self.changed()
        return [protocol.ActResult(shard=a.shard, status="error", detail=str(e)) for a in actions]

    def _tell(self, actions: list[protocol.ShardAction], results: list[protocol.ActResult]) -> None:
        """One log line per outcome (a submission of many shards is one)."""
        told: dict[tuple, list[int]] = {}
        asked = {a.shard: a for a in actions}
        for r in results:
            a = asked.get(r.shard)
            told.setdefault((a.kind if a else "act", a.by if a else "", r.status, r.detail), []).append(r.shard)
        for (kind, by, status, detail), ids in told.items():
            who = f"shard {ids[0]} ({self.store.where(ids[0])})" if len(ids) == 1 else f"shards {ids_text(ids)}"
            self.say(f"{who}: {kind} ({by}): {status}" + (f": {detail}" if detail else ""))


def ids_text(ids: list[int]) -> str:
    return ",".join(map(str, ids)) if len(ids) <= 8 else f"{ids[0]}..{ids[-1]} ({len(ids)})"
