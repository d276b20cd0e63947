"""Rows moved between hosts, carried out: each decide pass asks `fleet.relocate` (pure) which
orders are due from the hosts as the store holds them, and `RowMover` runs each on its host
(`python -m worker.relocate`), once at a time, holding an order off a while after it failed or
while its record is on the way. Apart from the supervisor so that what moves rows, and how it
retries, reads in one place.
"""

from __future__ import annotations

import time
from typing import Callable, Coroutine

from worker import protocol
from worker.text import runs_text

from . import deploy, relocate
from .config import Config
from .follow import HostLink
from .judge import Verdict
from .store import GIVEN_UP, Store
from .transport import HostError

FAILED_AGAIN_S = 10.0      # an order that failed is tried again this long after
COUNTED_AGAIN_S = 5.0      # an idle host's unfinished rows are counted again this long after
RECORDED_S = 30.0          # an order carried out: its record is on the way, not asked again before


class RowMover:
    """The orders of `fleet.relocate` carried out on the hosts, and when each may run again."""

    def __init__(self, config: Config, store: Store, links: dict[str, HostLink], moves_rows: bool,
                 say: Callable[[str], None], changed: Callable[[], None],
                 spawn: Callable[[Coroutine], None]):
        """`moves_rows`: the engine lets fleet move rows (an engine of tasks places its own);
        `say`: the supervisor's log; `changed`: the picture changed; `spawn`: run in its group."""
        self.config, self.store, self.links, self.moves_rows = config, store, links, moves_rows
        self.say, self.changed, self.spawn = say, changed, spawn
        self.due = False                                  # the last pass left orders to carry out
        self.moving: dict[relocate.Order, float] = {}     # order -> not again before (in flight: inf)

    def move(self, verdicts: dict[int, Verdict], now: float) -> None:
        """Rows of lost and idle hosts to the others, and hosts that are back told of it. The
        built-in worker, or a [job] taking its rows, over SSH: any other [job] keeps its fixed
        shards, and an engine of tasks places its tasks itself."""
        self.due = False
        sup, job = self.config.spec.supervise, self.config.spec.job
        if sup.host_lost_after is None or (job is not None and not job.takes_rows) or \
                not self.moves_rows or not self.store.replayed:
            return
        if not self.store.moves.moves and all(h.reachable is not False for h in self.store.hosts.values()) and \
                not any(v.state in GIVEN_UP for v in verdicts.values()):
            return                                      # the common pass: nothing lost, idle or moved
        due = relocate.orders(self.store.host_facts(verdicts, now, sup.host_lost_after), self.store.moves)
        self.due = bool(due)
        self.moving = {o: t for o, t in self.moving.items() if o in due or t > now}
        for order in due:
            if self.moving.get(order, 0.0) > now:          # in flight, or held off after it failed
                continue
            self.moving[order] = float("inf")
            if order.kind == "adopt":
                self.store.moves.ask(order, now)
            self.say(relocate.order_line(order))
            self.spawn(self.carry(order))

    async def tell_moved(self) -> list[str]:
        """One-shot (`fleet verify`, the hosts just read): every reachable host that has not
        recorded where its rows went while it was lost or idle is told now (revoke), from the other
        hosts' records, so its copies are marked and `verify --repair` can remove them. The lines
        say what was told."""
        lines: list[str] = []
        facts = self.store.host_facts({}, time.time(), None)
        for order in [o for o in relocate.orders(facts, self.store.moves) if o.kind == "revoke"]:
            lines.append(relocate.order_line(order))
            await self.carry(order, lines.append)
        return lines

    async def carry(self, order: relocate.Order, say: Callable[[str], None] | None = None) -> None:
        """One order on its host; what came of it said (`say`, else the supervisor's log)."""
        say = say or self.say
        link = self.links[order.host]
        kind = protocol.Unfinished if order.kind == "count" else protocol.Status
        reply: protocol.Reply | None = None
        try:
            reply = await deploy.run_worker_module(link.transport, self.config, link.spec, "relocate",
                                                   *self.args(order), reply=kind, timeout=60)
            why = reply.error if isinstance(reply, protocol.Unfinished) else \
                reply.detail if isinstance(reply, protocol.Status) and reply.status == "error" else None
        except HostError as e:
            why = str(e)
        if why is not None or not isinstance(reply, (protocol.Unfinished, protocol.Status)):
            self.store.moves.withdraw(order)
            self.moving[order] = time.time() + FAILED_AGAIN_S
            say(f"{order.host}: {order.kind} of rows from {order.from_host} failed: {why}")
        elif isinstance(reply, protocol.Unfinished):
            self.store.unfinished[order.host] = tuple((a, b) for a, b in reply.runs)
            self.moving[order] = time.time() + COUNTED_AGAIN_S
            n = sum(b - a for a, b in reply.runs)
            say(f"{order.host}: {n:,} row(s) not done: " + (runs_text(reply.runs[:8]) or "none"))
        else:
            self.moving[order] = time.time() + RECORDED_S
            if reply.status == "already":                   # ... or was there before: nothing new comes
                self.store.moves.withdraw(order)
            say(f"{order.host}: {order.kind}: {reply.status}: {reply.detail}")
        self.changed()

    def args(self, order: relocate.Order) -> list[str]:
        """`python -m worker.relocate`'s arguments for an order: where the host's pool keeps its
        ledger (a [job]'s in the run's folder), its shards, the rows and why they move."""
        link = self.links[order.host]
        job = self.config.spec.job
        num_rows = job.rows if job is not None else self.store.num_rows
        where = self.config.run_dir(link.spec) if job is not None else self.config.output_dir(link.spec)
        return [order.kind if order.kind != "count" else "pending", "--out", where,
                *(["--num-rows", str(num_rows)] if num_rows else []),
                "--run-dir", self.config.run_dir(link.spec), "--num-shards", str(self.store.num_shards),
                "--pool", ",".join(str(p.shard) for p in self.store.on(order.host)),
                "--rows", runs_text(order.runs), "--from-host", order.from_host,
                "--to-host", order.to_host, "--redone", str(order.redone), "--why", order.why]
