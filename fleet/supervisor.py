"""The supervisor: follows every host (`fleet.follow`) into one store (`fleet.store`) and carries
out what the judge says is due. No UI: the headless output and the TUI drive it, read its
snapshots and subscribe to its transitions.

Every 0.25 s the decide loop asks `fleet.judge` for each shard's verdict, publishes the shards
whose state changed (`Store.transitions`, computed once), turns what is due into typed actions
(`fleet.actions`) and hands each host's to the engine's Launcher (`fleet.engine`) in one
command. The user's restarts and stops (`request`, `stop_all`) take the same path after the same
rule. Whether an action happened is read from the record, never from how long its command took.
As an async context manager its tasks (a loop per host, the decide loop, the actions it spawned,
`[notify]`) live in one TaskGroup from `start()` until it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable

from worker import protocol
from worker.text import runs_text

from . import deploy, relocate, setup
from .actions import HostStop, UNDER_WAY, busy_mark, policy_action, refusal as action_refusal, user_action
from .config import Config
from .follow import HostLink, read_all
from .judge import Action, LaunchFailure, Verdict, policy_for
from .engine import make_launcher
from .notify import Notifier
from .schema import FleetSnapshot
from .state import LIVE, SETTLED, State
from .hosts import CATCH_UP_S
from .store import GIVEN_UP, Shard, Store, Transition
from .transport import HostError, HostUnusable, RunClaimed, make_transport

ACTION_TIMEOUT_S = 60.0       # an action whose outcome never shows up in the record: judge again
CLOSE_TIMEOUT_S = 10.0        # its tasks' end after the close's cancel (a quit must not hang)


class Supervisor:
    def __init__(self, config: Config, on_change: Callable[[], None] | None = None,
                 on_log: Callable[[str], None] | None = None, claim: protocol.SupervisorClaim | None = None,
                 take_over: bool = False, allow_partial: bool = False):
        """`claim`: hold the run on its hosts while following them (the run's supervisor does; a
        second one is then refused: `claimed`); `take_over`: from whoever holds it now."""
        self.config = config
        self.sup = config.spec.supervise
        self.on_change = on_change or (lambda: None)
        self.on_log = on_log or (lambda msg: None)
        self.launcher = make_launcher(config)
        self.store = Store(config, policy_for(config), self.launcher)
        self.allow_partial = allow_partial
        slots = asyncio.Semaphore(self.sup.max_concurrent_connects)
        self.links: dict[str, HostLink] = {
            h.name: HostLink(h, make_transport(h, self.sup, slots), self.store, self.launcher,
                             lambda: self.starved, lambda m: self.on_log(m), lambda: self._changed(),
                             claim=claim, take_over=take_over, prepare=self._preflight_late,
                             on_claimed=self._claimed)
            for h in config.hosts}
        self.claimed: RunClaimed | None = None      # another supervisor holds the run (its agents said)
        self.claimed_event = asyncio.Event()
        self._moves_due = False                     # the last decide pass left moves to carry out
        self.listeners: list[Callable[[list[Transition]], None]] = []
        self.replayed_event = asyncio.Event()       # every host replayed (or known down)
        self.settled_event = asyncio.Event()        # every shard settled, nothing in flight
        self.starved = 0.0                  # seconds the decide loop ran late lately (decaying max)
        self._group: asyncio.TaskGroup | None = None
        self.runner: asyncio.Task | None = None
        self._moving: dict[relocate.Order, float] = {}    # order -> not again before (in flight: inf)
        self._behind: set[str] = set()                    # hosts we were catching up with, as last told
        self._closers: list[Callable[[], object]] = []     # run at close
        self.notifier = Notifier(config.spec.notify, config.base_dir, lambda m: self.on_log(m)) \
            if config.spec.notify else None

    async def __aenter__(self) -> Supervisor:       # what the store holds is read through it
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    @property
    def shards(self) -> dict[int, Shard]:
        return self.store.shards

    @property
    def plan(self) -> protocol.Plan | None:
        return self.store.plan

    @property
    def replayed(self) -> bool:
        return self.store.replayed

    @property
    def acting(self) -> bool:
        return self.store.acting

    def verdict(self, shard: Shard, now: float | None = None) -> Verdict:
        return self.store.verdict(shard, now)

    def snapshot(self, now: float | None = None) -> FleetSnapshot:
        return self.store.snapshot(now)

    def subscribe(self, listener: Callable[[list[Transition]], None]) -> None:
        """`listener` gets every decide pass's transitions (never an empty list)."""
        self.listeners.append(listener)

    def _changed(self) -> None:
        if self.store.replayed:
            self.replayed_event.set()
        self.on_change()

    async def prepare(self, say: Callable[[str], None], step: Callable[[str], None], replan: bool = False,
                      width: int | None = None) -> protocol.Plan:
        """Deploy, preflight and settle the run's plan (fleet/setup.py); raises SetupRefused."""
        plan = await setup.prepare(self.links, self.config, self.launcher, say, step, self.live_shards, replan,
                                   self.allow_partial, width)
        self.store.use_plan(plan)
        return plan

    async def _preflight_late(self, link: HostLink) -> None:
        await setup.preflight_late(link, self.config, self.launcher, self.store.plan, self.on_log, self.allow_partial)

    def _claimed(self, e: RunClaimed) -> None:
        if self.claimed is None:
            self.claimed = e
            self.claimed_event.set()
            self.on_change()

    async def live_shards(self) -> list[str]:
        """'id (host:gpu)' of every shard whose process is alive, on every reachable host (a
        one-shot read of its own, beside whatever this supervisor follows)."""
        async with Supervisor(self.config) as probe:
            snap = await probe.read_once()
        return [f"{s.id} ({s.host}:{s.gpu})" for s in snap.shards if s.alive]

    def run_ended(self, snap: FleetSnapshot | None = None) -> bool:
        """Nothing more happens by itself: every host read, no action or move in flight or due
        (a host back from being lost is told of its rows first), and every shard settled or the
        run's rows all done (`snap`: the picture now, where the caller has it). The run's
        supervisor goes once its clients have read this."""
        if not self.store.replayed or self.store.acting or self.store.moves.in_flight or self._moves_due:
            return False
        snap = snap or self.snapshot()
        if any(self.store.published_state(s.id) != s.state for s in snap.shards):
            return False                                # its last transitions are not told yet
        return snap.totals.settled or snap.totals.finished

    async def read_once(self) -> FleetSnapshot:
        """Connect to every host, replay its record once, return the snapshot (same judge, no
        actions): `status`, `restart`, `logs`."""
        await read_all(self.store, self.links, self.config)
        return self.snapshot()

    async def start(self) -> None:
        """Open every host's agent stream and start carrying out verdicts."""
        started = asyncio.Event()

        async def run() -> None:
            async with asyncio.TaskGroup() as group:
                self._group = group
                for link in self.links.values():
                    link.task = group.create_task(link.follow(), name=f"host-{link.name}")
                group.create_task(self._decide_loop(), name="decide")
                if self.notifier is not None:
                    self.notifier.start(self.snapshot, group)
                    self.subscribe(self.notifier.told)
                started.set()
                await asyncio.Event().wait()           # until close() cancels this task
        self.runner = asyncio.create_task(run(), name="supervisor")
        await started.wait()

    async def wait_replayed(self, timeout: float = 60) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            async with asyncio.timeout(timeout):
                await self.replayed_event.wait()

    async def launch_all(self) -> None:
        """Launch every shard that is neither live nor done (what `fleet up` does on (re)attach):
        a manual launch, so failed, FATAL and stopped shards start over with a fresh budget; one
        command per host (an engine of tasks: one submission of all of them)."""
        await self.wait_replayed()
        due: dict[str, list[protocol.ShardAction]] = {}
        for s in self.shards.values():
            if self.store.hosts[s.placement.host].reachable and s.busy_since is None and not s.alive and \
                    not self.store.moves.untold(s.placement.host) and \
                    self.verdict(s).state not in LIVE | {State.DONE, State.QUEUED}:
                s.begin(time.time(), busy_mark(s.record))
                due.setdefault(s.placement.host, []).append(user_action(s.record, "restart", self.sup.stop_grace, s.id))
        await asyncio.gather(*(self.carry_out(self.links[h], acts) for h, acts in due.items()))

    async def _decide_loop(self) -> None:
        while True:
            try:
                self.decide(time.time())
            except Exception as e:                      # keep supervising whatever happens
                self.on_log(f"supervisor error: {type(e).__name__}: {e}")
            t0 = time.monotonic()
            await asyncio.sleep(0.25)
            late = time.monotonic() - t0 - 0.25         # how starved this process is (a loaded machine)
            self.starved = max(late, self.starved * 0.95)
            if late > CATCH_UP_S:                      # stopped or starved: what we know is old
                for link in self.links.values():
                    link.host.fell_behind()

    def _tell_catching_up(self) -> None:
        """Say once when the supervisor falls behind its hosts (stopped, starved, a backlog of
        lines) and when it has caught up: meanwhile nothing is restarted or failed on their word."""
        behind = {n: l.host for n, l in self.links.items() if l.host.reachable and l.host.catching_up}
        if behind and not self._behind:
            worst = max((h.behind_s for h in behind.values()), default=0.0)
            self.on_log(f"catching up: {worst:.0f} s behind {', '.join(sorted(behind))}" if worst else
                        f"catching up with {', '.join(sorted(behind))}: this process ran late; nothing is "
                        f"restarted or failed until their records are read up to now")
        elif self._behind and not behind:
            self.on_log("caught up")
        self._behind = set(behind)

    def decide(self, now: float) -> None:
        """One pass: judge every shard, publish what changed, and carry out what is due on each
        reachable, replayed host, one `act` per host for everything due there now."""
        verdicts: dict[int, Verdict] = {}
        due: dict[str, list[protocol.ShardAction]] = {}
        self._tell_catching_up()
        held = {name: not h.reachable or not h.replayed or h.catching_up or
                bool(self.store.moves.untold(name))               # told first of rows moved away
                for name, h in self.store.hosts.items()}
        for s in list(self.shards.values()):
            if s.busy_since is not None:
                s.settle(now, busy_mark(s.record), ACTION_TIMEOUT_S)
            v = verdicts[s.id] = self.verdict(s, now)
            if v.action == Action.NONE or held[s.placement.host] or s.busy_since is not None:
                continue
            action = policy_action(s.record, v, self.sup.stop_grace, s.id)
            if action is not None:
                s.begin(now, busy_mark(s.record))
                due.setdefault(s.placement.host, []).append(action)
        for host, actions in due.items():
            self._spawn(self.carry_out(self.links[host], actions))
        self.relocate(verdicts, now)
        self.publish(verdicts, now)

    def relocate(self, verdicts: dict[int, Verdict], now: float) -> None:
        """Rows of lost and idle hosts to the others, and hosts that are back told of it
        (fleet/relocate.py decides; `worker.relocate` carries it out). The built-in worker, or a
        [job] taking its rows, over SSH: any other [job] keeps its fixed shards, and an engine of tasks places
        its tasks itself."""
        self._moves_due = False
        job = self.config.spec.job
        if self.sup.host_lost_after is None or (job is not None and not job.takes_rows) or \
                not self.launcher.moves_rows or not self.store.replayed:
            return
        if not self.store.moves.moves and all(h.reachable is not False for h in self.store.hosts.values()) and \
                not any(v.state in GIVEN_UP for v in verdicts.values()):
            return                                      # the common pass: nothing lost, idle or moved
        due = relocate.orders(self.store.host_facts(verdicts, now, self.sup.host_lost_after), self.store.moves)
        self._moves_due = bool(due)
        self._moving = {o: t for o, t in self._moving.items() if o in due or t > now}
        for order in due:
            if self._moving.get(order, 0.0) > now:         # in flight, or held off after it failed
                continue
            self._moving[order] = float("inf")
            if order.kind == "adopt":
                self.store.moves.ask(order, now)
            self.on_log(relocate.order_line(order))
            self._spawn(self._carry_move(order))

    def _move_args(self, order: relocate.Order) -> list[str]:
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

    async def _carry_move(self, order: relocate.Order) -> None:
        link = self.links[order.host]
        kind = protocol.Unfinished if order.kind == "count" else protocol.Status
        try:
            reply = await deploy.run_worker_module(link.transport, self.config, link.spec, "relocate",
                                                   *self._move_args(order), reply=kind, timeout=60)
            why = reply.error if isinstance(reply, protocol.Unfinished) else \
                reply.detail if reply.status == "error" else None
        except HostError as e:
            why = str(e)
        if why is not None:
            self.store.moves.withdraw(order)
            self._moving[order] = time.time() + 10.0        # tried again then
            self.on_log(f"{order.host}: {order.kind} of rows from {order.from_host} failed: {why}")
        elif isinstance(reply, protocol.Unfinished):
            self.store.unfinished[order.host] = tuple((a, b) for a, b in reply.runs)
            self._moving[order] = time.time() + 5.0
            n = sum(b - a for a, b in reply.runs)
            self.on_log(f"{order.host}: {n:,} row(s) not done: " + (runs_text(reply.runs[:8]) or "none"))
        else:
            self._moving[order] = time.time() + 30.0        # its record is on the way
            if reply.status == "already":                   # ... or was there before: nothing new comes
                self.store.moves.withdraw(order)
            self.on_log(f"{order.host}: {order.kind}: {reply.status}: {reply.detail}")
        self.on_change()

    async def tell_moved(self) -> list[str]:
        """One-shot (`fleet verify`): every reachable host that has not recorded where its rows
        went while it was lost or idle is told now (revoke), from the other hosts' records, so its
        copies are marked and `verify --repair` can remove them. The lines say what was told."""
        await self.read_once()
        lines: list[str] = []
        facts = self.store.host_facts({}, time.time(), None)
        for order in [o for o in relocate.orders(facts, self.store.moves) if o.kind == "revoke"]:
            lines.append(relocate.order_line(order))
            told = self.on_log
            self.on_log = lines.append
            try:
                await self._carry_move(order)
            finally:
                self.on_log = told
        return lines

    def publish(self, verdicts: dict[int, Verdict], now: float) -> None:
        """Tell every listener what changed, once; note whether the run has settled."""
        changes = self.store.transitions(verdicts, now)
        shown = [self.store.published_state(k) for k in self.shards]
        if self.store.replayed and not self.store.acting and all(st in SETTLED for st in shown):
            self.settled_event.set()
        else:
            self.settled_event.clear()
        if changes:
            for listener in self.listeners:
                listener(changes)
            self.on_change()

    def _spawn(self, coro) -> None:
        async def guarded() -> None:                    # a bug in one action must not end the group
            try:
                await coro
            except Exception as e:
                self.on_log(f"supervisor error: {type(e).__name__}: {e}")
        if self._group is not None:
            self._group.create_task(guarded())
        else:                                           # decide() called without start() (tests)
            coro.close()

    async def carry_out(self, link: HostLink, actions: list[protocol.ShardAction],
                        wait: float = 0.0) -> list[protocol.ActResult]:
        """Send actions to one host's launcher. A command that could not run there is a failed
        launch for every launch or restart in it (counted by the judge); a command that timed out
        says nothing: the record does, and the verdict decides again."""
        places = {p.shard: p for p in self.store.on(link.name)}
        try:
            results = await self.launcher.act(link.transport, link.spec, actions, places, self.store.num_shards, wait)
        except HostError as e:
            why = str(e).removeprefix(f"{link.name}: ")
            for a in actions:
                s = self.shards[a.shard]
                if isinstance(e, HostUnusable) and a.kind != "stop":
                    s.launch_failed(LaunchFailure(link.host.host_now(time.time()), a.by, why))
                else:
                    s.done_acting()
            told = "failed" if isinstance(e, HostUnusable) else "not confirmed (the host's record will say)"
            self.on_log(f"shards {_ids([a.shard for a in actions])}: {actions[0].kind} {told}: {why}")
            self.on_change()
            return [protocol.ActResult(shard=a.shard, status="error", detail=str(e)) for a in actions]
        told: dict[tuple, list[int]] = {}
        asked = {a.shard: a for a in actions}
        for r in results:
            if (s := self.shards.get(r.shard)) is not None and r.status not in UNDER_WAY:
                s.done_acting()              # nothing was done (stale, busy, refused): judge again
            a = asked.get(r.shard)
            told.setdefault((a.kind if a else "act", a.by if a else "", r.status, r.detail), []).append(r.shard)
        for (kind, by, status, detail), ids in told.items():   # one line per outcome: a submission is one
            who = f"shard {ids[0]} ({self.store.where(ids[0])})" if len(ids) == 1 else f"shards {_ids(ids)}"
            self.on_log(f"{who}: {kind} ({by}): {status}" + (f": {detail}" if detail else ""))
        return results

    # --- the user's actions (the TUI's keys, fleet restart / down) -------------------------------
    def refusal(self, shard_id: int, kind: str) -> str | None:
        """Why this action cannot apply to this shard now (the same rule for every caller)."""
        s = self.shards.get(shard_id)
        if s is None:
            return f"no shard {shard_id}"
        v = self.verdict(s)                         # the decision the screen shows
        return action_refusal(kind, v.state, shard_id, verifiable=self.config.spec.job is None, why=v.reason)

    async def request(self, shard_ids: list[int], kind: str,
                      wait: float = 0.0) -> dict[int, protocol.ActResult]:
        """The user's restart or stop of these shards: refused by the one rule (`fleet.actions`;
        status "refused"), else carried out through the launcher, one command per host (`wait`: until
        each stop or restart is done on the host)."""
        out: dict[int, protocol.ActResult] = {}
        by_host: dict[str, list[protocol.ShardAction]] = {}
        for k in shard_ids:
            why = self.refusal(k, kind)
            if why is not None:
                out[k] = protocol.ActResult(shard=k, status="refused", detail=why)
                continue
            s = self.shards[k]
            s.begin(time.time(), busy_mark(s.record))
            by_host.setdefault(s.placement.host, []).append(user_action(s.record, kind, self.sup.stop_grace, k))
        results = await asyncio.gather(*(self.carry_out(self.links[h], acts, wait) for h, acts in by_host.items()))
        for batch in results:
            out.update((r.shard, r) for r in batch)
        return dict(sorted(out.items()))

    async def stop_all(self, timeout: float | None = None) -> list[HostStop]:
        """`fleet down` / D: a run stop of every shard on every host, whatever its state (a shard
        waiting for a restart, or never launched, is STOPPED too); waits for each to be carried out.
        Returns each host's part: its shards' outcomes, or why it could not be reached."""
        grace = self.sup.stop_grace if timeout is None else timeout
        if not self.shards:                      # a one-shot command: the plan's shards, or the records'
            await self.read_once()

        async def one(link: HostLink) -> HostStop:
            try:
                await link.transport.connect()
            except HostError as e:
                return HostStop(link.name, error=str(e))
            ids = [p.shard for p in self.store.on(link.name)]
            if not ids:
                return HostStop(link.name)
            actions = [protocol.ShardAction(shard=k, kind="stop", why="run", grace=grace) for k in ids]
            results = await self.carry_out(link, actions, wait=grace + 30)
            if results and all(r.status == "error" for r in results):
                return HostStop(link.name, error=results[0].detail or "error")
            return HostStop(link.name, {r.shard: (r.detail or r.status) for r in results})
        return list(await asyncio.gather(*(one(l) for l in self.links.values())))

    async def log_lines(self, shard_id: int, last: int = 200, follow: bool = True):
        """A shard's log: its last `last` lines, then (`follow`) new ones until the stream ends.
        Raises HostError when the host cannot be read."""
        link = self.links[self.shards[shard_id].placement.host]
        async for line in link.lines(self.launcher.log_argv(link.spec, shard_id, last, follow), follow):
            yield line

    def resolve_shard(self, ref: str) -> int:
        return self.store.resolve(ref)

    def on_close(self, callback: Callable[[], object]) -> None:
        """Run `callback` when the supervisor closes (a server beside it, say)."""
        self._closers.append(callback)

    async def close(self) -> None:
        """Stop following (telling what just changed first); the workers keep running."""
        for callback in self._closers:
            callback()
        self._closers = []
        if self.runner is not None:
            now = time.time()                           # the last changes are told
            self.publish({k: self.verdict(s, now) for k, s in self.shards.items()}, now)
            self.runner.cancel()
            await asyncio.wait([self.runner], timeout=CLOSE_TIMEOUT_S)
            if not self.runner.done():                  # a task that ignores its cancel: say so, go on
                stuck = [l.task.get_name() for l in self.links.values() if l.task and not l.task.done()]
                self.on_log(f"supervisor error: its tasks did not stop within {CLOSE_TIMEOUT_S:.0f}s of "
                            f"the close ({', '.join(stuck) or 'its decide loop'}); left behind")
            self.runner = self._group = None
        if self.notifier is not None:
            await self.notifier.close()
        for link in self.links.values():
            await link.drop()


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids)) if len(ids) <= 8 else f"{ids[0]}..{ids[-1]} ({len(ids)})"
