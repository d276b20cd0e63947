"""The supervisor's state, in one store: one `Host` and one `Shard` per entity, changed only through
their methods, and the fold of what the hosts' agents say into them (`Store.apply`). Everything
else reads: `snapshot()` is a pure projection of the store for a moment, and `transitions()` is the
one place that says which shards changed state (the decide loop calls it once a pass and publishes
what it returns to the headless output, `[notify]` and the live view).

No I/O here: the host loops (`fleet.follow`) feed `apply` with the lines they read; the supervisor
asks `verdict` and `transitions` and records its own actions on the shards (`begin`, `settle`).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from worker import protocol

from .config import Config
from .jobs import Placement
from .judge import LaunchFailure, Policy, Verdict, judge
from .plan import removed_hosts
from .record import ShardRecord
from .relocate import HostFacts, Moves, planned_rows
from .hosts import Host
from .schema import FleetSnapshot
from .snapshot import ShardView, all_replayed, build_snapshot
from .state import State
from .transport import HostError, HostUnusable, RunClaimed
from .verdicts import Judged, holds, reads, silence


EXTRAPOLATE_S = 10.0      # a shard's idle time is carried past its host's last word by at most this
VERSIONS = itertools.count(1)    # a record's version: unique across shards, old and replayed anew


@dataclass
class Shard:
    """One shard as the supervisor holds it: its place, its folded record, its liveness, and what
    only the supervisor knows (actions in flight, launches that never reached the host)."""
    placement: Placement
    record: ShardRecord
    alive: bool | None = None
    pid: int | None = None
    launch_failures: list[LaunchFailure] = field(default_factory=list)
    acting: bool | None = None           # a stop or restart is being carried out on the host
    idle_s: float | None = None          # the host's monotonic seconds since its last progress...
    idle_at: float = 0.0                 # ...as of this moment of ours (time.monotonic())
    busy_since: float | None = None      # an action is in flight (supervisor clock)
    busy_mark: tuple = ()                # the record's busy_mark when it began
    task: protocol.TaskState | None = None      # what its engine says now of its newest launch's task
    gpus: protocol.TaskGpus | None = None        # the GPUs that task reported
    damage: protocol.RecordDamage | None = None  # what of its record could not be read
    record_version: int = field(default_factory=lambda: next(VERSIONS))   # new with each event folded

    @property
    def id(self) -> int:
        return self.placement.shard

    def fold(self, ev: protocol.Event, live: bool) -> None:
        """One event of its record (`live`: followed as it happened, not replayed)."""
        self.record_version = next(VERSIONS)
        self.record.apply(ev)
        if isinstance(ev, protocol.Launch):
            self.launch_failures.clear()
            self.alive = None            # liveness read before this launch says nothing of it
        if isinstance(ev, protocol.PROGRESS_EVENTS) and live:
            self.idle_s, self.idle_at = 0.0, time.monotonic()

    def liveness(self, msg: protocol.Liveness) -> None:
        """Its host's word on its process, every telemetry interval (what the judge reads of it,
        alive and acting, is compared where its verdict is kept: fleet.verdicts)."""
        self.alive, self.pid, self.acting = msg.alive, msg.pid, msg.acting
        self.idle_s, self.idle_at = msg.idle_s, time.monotonic()

    def idle(self) -> float | None:
        """Seconds since the shard's last progress on monotonic clocks (the host's, then ours):
        a step of either wall clock changes nothing. None: not reported (the record's stamps rule)."""
        if self.idle_s is None or not self.alive:
            return None
        return self.idle_s + min(max(time.monotonic() - self.idle_at, 0.0), EXTRAPOLATE_S)

    def begin(self, now: float, mark: tuple) -> None:
        """An action of ours is in flight; `mark`: the record's busy_mark as it begins."""
        self.busy_since, self.busy_mark = now, mark

    def settle(self, now: float, mark: tuple, timeout: float) -> None:
        """The action is over once the record shows what it did (its busy_mark moved), or, the
        outcome never showing up, after `timeout`: the verdict decides again."""
        if self.busy_since is not None and (mark != self.busy_mark or now - self.busy_since > timeout):
            self.busy_since = None

    def done_acting(self) -> None:
        self.busy_since = None

    def launch_failed(self, failure: LaunchFailure) -> None:
        self.busy_since = None
        self.launch_failures.append(failure)

    def replayed_anew(self, needs_done_sentinel: bool) -> Shard:
        """A fresh record for a new stream's replay, keeping what only the supervisor knows."""
        return Shard(self.placement, ShardRecord(needs_done_sentinel=needs_done_sentinel),
                     launch_failures=self.launch_failures, busy_since=self.busy_since,
                     busy_mark=self.busy_mark)


@dataclass(frozen=True)
class Transition:
    """A shard's shown state changed, or it failed again (`failed`), between two decide passes.
    `before` None: the first state known of it (a host's replay), history rather than news."""
    shard: int
    before: State | None
    after: State
    failed: bool
    t: float


GIVEN_UP = (State.FATAL, State.STOPPED)


def idle_host(shards: list[tuple[State, bool]]) -> bool:
    """A reachable host that can do nothing more with rows it still holds: every shard (state,
    holds rows) FATAL, STOPPED or DONE, and one that gave up or was stopped still holding rows."""
    return bool(shards) and all(st in GIVEN_UP or st == State.DONE for st, _ in shards) and \
        any(st in GIVEN_UP and holds for st, holds in shards)


def changes(shown: dict[int, tuple[State, int]], current: list[tuple[int, State, int]],
            t: float) -> list[Transition]:
    """The transitions from what was last published (`shown`, updated) to `current` (shard,
    state, failures ever): a new state, or the same state with more failures (a failure whose
    restart came before anyone looked)."""
    out = []
    for k, state, failures in current:
        before = shown.get(k)
        failed = before is not None and failures > before[1]
        if before is None or state != before[0] or failed:
            out.append(Transition(k, before[0] if before else None, state, failed, t))
            shown[k] = (state, failures)
    return out


class Placer(Protocol):
    """What the store asks of the engine (the Launcher, fleet/engine/): its hosts, the plan's
    shards placed, where a shard's attempt runs, and the hosts it shows beside them."""

    def first_hosts(self) -> dict[str, Host]: ...
    def placements(self, plan: protocol.Plan) -> list[Placement]: ...
    def view(self, shard: Shard, view: ShardView) -> ShardView: ...
    def nodes(self, store: Store) -> dict[str, Host]: ...


class Store:
    """Every host and shard of the run, and the run's plan."""

    def __init__(self, config: Config, policy: Policy, engine: Placer):
        self.config = config
        self.policy = policy
        self.engine = engine                # where shards run: the Launcher (fleet/engine/)
        self.hosts: dict[str, Host] = engine.first_hosts()
        self.shards: dict[int, Shard] = {}
        self.placements: list[Placement] = []
        self.plan: protocol.Plan | None = None
        self.shown: dict[int, tuple[State, int]] = {}    # shard -> (state, failures) last published
        self.moves = Moves()                              # rows moved between hosts (fleet/relocate.py)
        self.judged: dict[int, Judged] = {}               # each shard's newest verdict (Store.verdict)
        self._on: dict[str, list[Placement]] | None = None   # placements by host (Store.on)
        self.unfinished: dict[str, tuple] = {}            # an idle host's rows not done, as it counted them

    @property
    def num_shards(self) -> int:
        return len(self.placements)

    def on(self, host: str) -> list[Placement]:
        """The host's shards' places (asked at every line a host sends: kept by host)."""
        if self._on is None:
            self._on = {}
            for p in self.placements:
                self._on.setdefault(p.host, []).append(p)
        return self._on.get(host, [])

    # --- the plan ----------------------------------------------------------------------------------
    def use_plan(self, plan: protocol.Plan) -> None:
        """Take the shard layout from the run's plan and create the shard records."""
        self.plan = plan
        self.placements = self.engine.placements(plan)
        self.shards = {p.shard: self._new(p) for p in self.placements}
        self.judged, self._on = {}, None
        for name in removed_hosts(plan, self.config):     # its rows go to the others, as a lost host's
            self.hosts.setdefault(name, Host.removed_from_config(name))

    def forget(self) -> None:
        """No plan, no shards (a one-shot read starts here and finds them)."""
        self.shards, self.placements, self.plan, self.moves = {}, [], None, Moves()
        self.judged, self._on = {}, None

    def host_facts(self, verdicts: dict[int, Verdict], now: float, after: float | None) -> list[HostFacts]:
        """Each host as fleet/relocate.py needs it: lost or usable, whether it had work, its rows."""
        num_rows = self.num_rows
        by_host: dict[str, list[Shard]] = {name: [] for name in self.hosts}
        for s in self.shards.values():
            by_host.setdefault(s.placement.host, []).append(s)
        out = []
        for name, host in self.hosts.items():
            mine = by_host[name]
            usable = host.reachable is True and host.replayed
            idle = usable and idle_host([(verdicts[s.id].state, s.record.holds_rows) for s in mine if s.id in verdicts])
            if not idle:
                self.unfinished.pop(name, None)         # counted again if it is idle again later
            out.append(HostFacts(
                name, tuple(s.id for s in mine), host.lost(now, after), usable=usable,
                had_work=any((verdicts[s.id].recorded or verdicts[s.id].state) != State.DONE
                             for s in mine if s.id in verdicts),
                finished_rows=sum(s.record.done + s.record.skipped for s in mine),
                planned=tuple(planned_rows({s.id: s.record.planned for s in mine}, num_rows, self.num_shards)),
                idle=idle, unfinished=self.unfinished.get(name), removed=host.removed))
        return out

    @property
    def num_rows(self) -> int | None:
        """The run's rows, as the shards' records say (their `started` events)."""
        return max((s.record.num_rows or 0 for s in self.shards.values()), default=0) or None

    def _new(self, p: Placement) -> Shard:
        return Shard(p, ShardRecord(needs_done_sentinel=self.policy.needs_done_sentinel))

    def discover(self, host: str, k: int, ev: protocol.Record) -> Shard | None:
        """A shard found on a host with no plan (status, restart, logs): its first record, the
        launch, names its GPU."""
        if not isinstance(ev, protocol.Launch):
            return None
        place = Placement(k, host, ev.gpu if ev.gpu is not None else -1)
        self.placements.append(place)
        self._on = None
        shard = self.shards[k] = self._new(place)
        return shard

    def another_machine(self, host: str, host_id: str | None) -> str | None:
        """The plan's machine for this host name is not the one that answered (names swapped in
        fleet.toml): nothing is done there, by any command."""
        planned = self.plan.host_ids.get(host) if self.plan else None
        if planned and host_id and planned != host_id:
            return (f"{host} is another machine: the plan's {host} is {planned}, this one is {host_id} "
                    f"(names swapped or an address changed in fleet.toml?); nothing done there")
        return None

    # --- the fold of an agent's lines -----------------------------------------------------------------
    def replay_starts(self, host: str) -> None:
        """A new stream replays everything: this host's shards start from a clean record."""
        for p in self.on(host):
            old = self.shards.get(p.shard)
            self.shards[p.shard] = old.replayed_anew(self.policy.needs_done_sentinel) if old else self._new(p)
        self.hosts[host].replay_starts()

    def apply(self, host_name: str, msg: protocol.Message, discover: bool = False,
              now: float | None = None) -> protocol.Record | None:
        """One message of a host's agent; the event it carried, once folded. Raises HostError
        where it says the host cannot be used. Each kind of message has its fold (`_FOLDS`); one
        nothing folds (a beat) only says the host is there."""
        host = self.hosts[host_name]
        sent = None if isinstance(msg, protocol.TaskGpus) else getattr(msg, "t", None)   # (its reading's time)
        host.heard(sent, time.time() if now is None else now)
        fold = _fold_of(type(msg))
        return fold(self, host_name, msg, discover) if fold is not None else None

    def _hello(self, at: str, msg: protocol.Hello, discover: bool) -> None:
        if msg.protocol != protocol.PROTOCOL_VERSION:
            raise HostError(f"{at}: host runs worker protocol {msg.protocol}, this fleet "
                            f"speaks {protocol.PROTOCOL_VERSION}: redeploy (fleet up)")
        if (why := self.another_machine(at, msg.host_id)) is not None:
            raise HostUnusable(f"{at}: {why}")
        if not discover:
            self.replay_starts(at)

    def _event(self, at: str, msg: protocol.EventMessage, discover: bool) -> protocol.Record | None:
        ev = msg.event
        if isinstance(ev, protocol.Relocated):
            self.moves.seen(ev)
        shard = self.shards.get(msg.shard)
        if shard is None and ev is not None and discover:
            shard = self.discover(at, msg.shard, ev)
        if shard is None or ev is None:
            return None
        shard.fold(ev, live=self.hosts[at].replayed)
        return ev

    def _liveness(self, at: str, msg: protocol.Liveness, discover: bool) -> None:
        if (shard := self.shards.get(msg.shard)) is not None:
            shard.liveness(msg)

    def _idle(self, at: str, msg: protocol.Idle, discover: bool) -> None:
        now = time.monotonic()
        for k, idle_s in zip(msg.shards, msg.idle_s):
            if (shard := self.shards.get(k)) is not None:     # (Shard.idle: only while alive)
                shard.idle_s, shard.idle_at = idle_s, now

    def _damage(self, at: str, msg: protocol.RecordDamage, discover: bool) -> None:
        if (shard := self.shards.get(msg.shard)) is not None:
            shard.damage = msg

    def _task(self, at: str, msg: protocol.TaskState, discover: bool) -> None:
        if (shard := self.shards.get(msg.shard)) is not None:
            shard.task = msg

    def _task_gpus(self, at: str, msg: protocol.TaskGpus, discover: bool) -> None:
        if (shard := self.shards.get(msg.shard)) is not None:
            shard.gpus = msg

    def _engine_poll(self, at: str, msg: protocol.EnginePoll, discover: bool) -> None:
        self.hosts[at].engine_said(msg)

    def _gpus(self, at: str, msg: protocol.GpuReading, discover: bool) -> None:
        self.hosts[at].read_gpus(msg)

    def _disk(self, at: str, msg: protocol.DiskReading, discover: bool) -> None:
        self.hosts[at].read_disk(msg)

    def _replayed(self, at: str, msg: protocol.Replayed, discover: bool) -> None:
        self.hosts[at].replay_done()

    def _agent_error(self, at: str, msg: protocol.AgentError, discover: bool) -> None:
        raise HostError(f"{at}: agent failed: {msg.message}")

    def _claimed(self, at: str, msg: protocol.Claimed, discover: bool) -> None:
        raise RunClaimed(f"{at}: the run is supervised by another supervisor", msg.holder)

    def resolve(self, ref: str) -> int:
        """'3' or 'host:gpu' -> shard id (KeyError with a message otherwise)."""
        if ref.isascii() and ref.isdigit() and int(ref) in self.shards:     # '¹'.isdigit() too
            return int(ref)
        if ":" in ref:
            host, _, gpu = ref.rpartition(":")
            for s in self.shards.values():
                if s.placement.host == host and str(s.placement.gpu) == gpu:
                    return s.id
        known = ", ".join(f"{s.id} ({s.placement.host}:{s.placement.gpu})" for s in self.shards.values()) or "none"
        raise KeyError(f"no shard {ref!r}; shards: {known}")

    def where(self, shard_id: int) -> str:
        s = self.shards.get(shard_id)
        return f"{s.placement.host}:{s.placement.gpu}" if s is not None else "?"

    def published_state(self, shard_id: int) -> State | None:
        """The state last published for the shard (None before any)."""
        return self.shown.get(shard_id, (None,))[0]

    # --- reading -------------------------------------------------------------------------------------
    @property
    def replayed(self) -> bool:
        """Every host's agent has replayed its record, or the host is known unreachable."""
        return all_replayed(self.hosts.values())

    @property
    def acting(self) -> bool:
        """An action (a launch, a submission, a restart) is in flight: its record is not in yet."""
        return any(s.busy_since is not None for s in self.shards.values())

    def verdict(self, shard: Shard, now: float | None = None) -> Verdict:
        """The judge's verdict on the shard at `now` (default: now), judged once for every reader —
        the decide pass, the snapshot, a refusal — and again only when what the judge reads of it
        changed or time moved it past a threshold (fleet/verdicts.py): a GPU or disk reading, a
        beat or the passing of time alone does not judge a shard again."""
        now = time.time() if now is None else now
        host = self.hosts[shard.placement.host]
        down = host.down_reason
        host_now = host.host_now(now)
        idle = shard.idle()
        basis = reads(shard.record_version, shard.alive, shard.acting, shard.task, len(shard.launch_failures), down)
        taken = self.judged.get(shard.id)
        if taken is not None and taken.reads == basis and \
                taken.holds.covers(host_now, lambda: silence(shard.record, host_now, idle)):
            return taken.verdict
        v = judge(shard.record, shard.alive, host_now, self.policy, tuple(shard.launch_failures), shard.task,
                  shard.acting, idle, down)
        said = v if down is None else Verdict(v.recorded or v.state)    # UNKNOWN: its state alone counts
        self.judged[shard.id] = Judged(basis, holds(shard.record, said, host_now, self.policy, shard.acting,
                                                    idle, state_only=down is not None), v)
        return v

    def transitions(self, verdicts: dict[int, Verdict], now: float) -> list[Transition]:
        """The shards whose shown state changed, or that failed again, since the last call (each
        change is returned once). A shard of a host still replaying has no state to show yet, nor
        one of a host we are catching up with: judged on what we knew before we fell behind (a
        stopped or starved supervisor), its verdict is provisional — its shards' silence then is
        ours — and is published once its lines are read up to now."""
        current = []
        for k, v in verdicts.items():
            s = self.shards[k]
            host = self.hosts[s.placement.host]
            if (host.replayed and not host.catching_up) or host.reachable is False:
                current.append((k, v.state, s.record.failures))
        return changes(self.shown, current, now)

    def snapshot(self, now: float | None = None) -> FleetSnapshot:
        """The picture of the run at `now` (supervisor clock): a projection, nothing changes."""
        now = time.time() if now is None else now
        views = [self._view(s, now) for s in sorted(self.shards.values(), key=lambda s: s.id)]
        hosts = {**self.hosts, **self.engine.nodes(self)}
        return build_snapshot(self.config.run.name, views, hosts, now, self.config.spec.expected,
                              (self.moves.rows, self.moves.redone), verifiable=self.config.spec.job is None,
                              moving=self.moves.in_flight)

    def _view(self, s: Shard, now: float) -> ShardView:
        p = s.placement
        verdict = self.verdict(s, now)                            # (the decide pass's, while fresh)
        return self.engine.view(s, ShardView(
            s.id, p.host, p.gpu, s.record, verdict, s.alive, s.pid, self.policy.max_restarts,
            gpus=p.all_gpus, idle_s=s.idle(), moved_to=self.moves.moved_to(p.host, s.record.leased_t),
            damage=s.damage))


_FOLDS: dict[type, Callable[..., protocol.Record | None]] = {
    protocol.Hello: Store._hello, protocol.EventMessage: Store._event, protocol.Liveness: Store._liveness,
    protocol.Idle: Store._idle, protocol.RecordDamage: Store._damage, protocol.TaskState: Store._task,
    protocol.TaskGpus: Store._task_gpus, protocol.EnginePoll: Store._engine_poll, protocol.GpuReading: Store._gpus,
    protocol.DiskReading: Store._disk, protocol.Replayed: Store._replayed, protocol.AgentError: Store._agent_error,
    protocol.Claimed: Store._claimed}


def _fold_of(kind: type) -> Callable[..., protocol.Record | None] | None:
    """The fold of a kind of message (a subclass folds as its message does); None: nothing to fold."""
    return next((_FOLDS[c] for c in kind.__mro__ if c in _FOLDS), None)
