"""The supervisor: follows every host (`fleet.follow`) into one store (`fleet.store`) and carries
out what the judge says is due. No UI: the headless output and the TUI drive it, read its
snapshots and subscribe to its transitions. It keeps the loop and the wiring; each job is a part.

Every 0.25 s the decide loop asks the store for each shard's verdict, publishes the shards whose
state changed (`Store.transitions`, computed once), turns what is due into typed actions
(`fleet.actions`) and hands each host's to `fleet.carrier` (the engine's Launcher, one command),
then has `fleet.moving` carry out the rows due to move between hosts. The user's restarts and
stops (`fleet.user_actions`: `request`, `stop_all`) take the same path after the same rule.
Whether an action happened is read from the record, never from how long its command took.
As an async context manager its tasks (a loop per host, the decide loop, the actions it spawned,
`[notify]`) live in one TaskGroup from `start()` until it closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Callable

from worker import protocol

from . import setup
from .actions import HostStop, busy_mark, policy_action
from .carrier import Carrier
from .catching_up import CatchingUp
from .config import Config
from .follow import HostLink, read_all
from .judge import Action, Verdict, policy_for
from .engine import make_launcher
from .moving import RowMover
from .notify import Notifier
from .schema import FleetSnapshot
from .state import SETTLED
from .hosts import CATCH_UP_S
from .store import Shard, Store, Transition
from .transport import RunClaimed, make_transport
from .user_actions import UserActions

ACTION_TIMEOUT_S = 60.0       # an action whose outcome never shows up in the record: judge again
CLOSE_TIMEOUT_S = 10.0        # its tasks' end after the close's cancel (a quit must not hang)


class Supervisor:
    """One run's supervision: its hosts followed, its store, its decide loop, and the parts that act."""

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
        self.listeners: list[Callable[[list[Transition]], None]] = []
        self.replayed_event = asyncio.Event()       # every host replayed (or known down)
        self.settled_event = asyncio.Event()        # every shard settled, nothing in flight
        self.starved = 0.0                  # seconds the decide loop ran late lately (decaying max)
        self._group: asyncio.TaskGroup | None = None
        self.runner: asyncio.Task | None = None
        self._closers: list[Callable[[], object]] = []     # run at close
        self.notifier = Notifier(config.spec.notify, config.base_dir, lambda m: self.on_log(m)) \
            if config.spec.notify else None
        say, changed = (lambda m: self.on_log(m)), (lambda: self.on_change())
        self.carrier = Carrier(self.store, self.launcher, say, changed)
        self.mover = RowMover(config, self.store, self.links, self.launcher.moves_rows, say, changed, self._spawn)
        self.catching_up = CatchingUp(say)
        self.user = UserActions(config, self.store, self.links, self.carrier, self.verdict, self.read_once,
                                self.wait_replayed)

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
        plan = self.store.plan
        assert plan is not None, "a late host is preflighted only once setup settled the run's plan"
        await setup.preflight_late(link, self.config, self.launcher, plan, self.on_log, self.allow_partial)

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
        if not self.store.replayed or self.store.acting or self.store.moves.in_flight or self.mover.due:
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
        """Every shard that is neither live nor done, launched (fleet/user_actions.py)."""
        await self.user.launch_all()

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

    def decide(self, now: float) -> None:
        """One pass: judge every shard, publish what changed, and carry out what is due on each
        reachable, replayed host, one `act` per host for everything due there now."""
        verdicts: dict[int, Verdict] = {}
        due: dict[str, list[protocol.ShardAction]] = {}
        self.catching_up.look({n: l.host for n, l in self.links.items()})
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
            self._spawn(self.carrier.carry_out(self.links[host], actions))
        self.mover.move(verdicts, now)
        self.publish(verdicts, now)

    async def tell_moved(self) -> list[str]:
        """One-shot (`fleet verify`): hosts back from being lost or idle told where their rows went
        (fleet/moving.py); the lines say what was told."""
        await self.read_once()
        return await self.mover.tell_moved()

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

    # --- the user's actions (the TUI's keys, fleet restart / down): fleet/user_actions.py -------
    def refusal(self, shard_id: int, kind: str) -> str | None:
        return self.user.refusal(shard_id, kind)

    async def request(self, shard_ids: list[int], kind: str, wait: float = 0.0) -> dict[int, protocol.ActResult]:
        return await self.user.request(shard_ids, kind, wait)

    async def stop_all(self, timeout: float | None = None) -> list[HostStop]:
        return await self.user.stop_all(timeout)

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

