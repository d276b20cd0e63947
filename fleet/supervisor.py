"""The supervisor: connects to every host, deploys, follows each host's agent, and carries out what
the judge says is due. No UI: the CLI's headless mode and the TUI both drive it and read its
snapshots.

Each host has one task that keeps an agent stream open (reconnecting with capped exponential
backoff). A new stream replays the host's records from the start into fresh ShardRecords, so the
picture after a reconnect or a supervisor restart is the host's own record, never a guess. The
supervisor decides nothing itself: every 0.25 s it asks `fleet.judge` for each shard's verdict,
turns what is due into typed actions (`fleet.actions`) and hands each host's to the engine's
Launcher (`fleet.launcher`) in one command. The user's restarts and stops (`request`, `stop_all`)
take the same path after the same rule. Whether an action happened is read from the record, never
from how long its command took: the supervisor only keeps which actions are in flight and launches
that failed before reaching a host's record.

With [slurm] there is one "host", the login node: the same agent runs there (reading every shard's
record on the shared filesystem, asking squeue); the Launcher submits arrays and cancels tasks; the
judge and the snapshot are the same.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from worker import protocol
from worker.identity import differences

from . import deploy
from .actions import UNDER_WAY, busy_mark, policy_action, refusal as action_refusal, user_action
from .config import Config, HostSpec
from .jobs import Placement
from .judge import LaunchFailure, Policy, Verdict, judge
from .launcher import make_launcher
from .notify import Notifier
from .plan import PlanError, check_hosts, make_plan, placements, plan_differences, refusal
from .record import ShardRecord
from .snapshot import (FleetSnapshot, HostView, ShardView, all_replayed, build_snapshot, slurm_nodes,
                       slurm_task)
from .state import LIVE, State
from .transport import HostError, HostUnusable, Stream, Transport, make_transport

AGENT_SILENCE_S = 5.0         # no line from an agent for this long: the host is unreachable...
SILENCE_PER_ACTION_S = 2.0    # ...plus this per shard starting or acted on there (a launch storm)
STARTING_UP = frozenset({State.STARTING, State.LOADING, State.STOPPING})
AGENT_START_S = 30.0          # a new agent stream: its Python start and replay, on a loaded host
ACTION_TIMEOUT_S = 60.0       # an action whose outcome never shows up in the record: judge again


@dataclass
class ShardSlot:
    """One shard as the supervisor holds it: its place, its folded record, its liveness."""
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
    last_state: State | None = None
    slurm: protocol.SlurmTask | None = None      # what Slurm says now of its newest launch's task
    gpus: protocol.TaskGpus | None = None        # the GPUs that task reported

    @property
    def id(self) -> int:
        return self.placement.shard


@dataclass
class HostLink:
    spec: HostSpec
    transport: Transport
    host: HostView
    placements: list[Placement] = field(default_factory=list)
    stream: Stream | None = None
    task: asyncio.Task | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    diagnostics: deque = field(default_factory=lambda: deque(maxlen=5))


def policy_for(config: Config) -> Policy:
    sup, job = config.spec.supervise, config.spec.job
    has_progress = job is None or bool(job.progress or job.progress_glob)
    return Policy(max_restarts=sup.max_restarts, backoff_base=sup.backoff_base,
                  backoff_max=sup.backoff_max,
                  stall_timeout=sup.stall_timeout if has_progress else None,
                  restart_stalled=sup.restart_stalled, needs_done_sentinel=bool(job and job.done),
                  custom_job=job is not None)


class Supervisor:
    def __init__(self, config: Config, on_change: Callable[[], None] | None = None,
                 on_log: Callable[[str], None] | None = None):
        self.config = config
        self.sup = config.spec.supervise
        self.policy = policy_for(config)
        self.on_change = on_change or (lambda: None)
        self.on_log = on_log or (lambda msg: None)
        slots = asyncio.Semaphore(self.sup.max_concurrent_connects)
        self.slurm = config.slurm
        self.launcher = make_launcher(config)
        self.links: dict[str, HostLink] = {
            h.name: HostLink(h, make_transport(h, self.sup, slots),
                             HostView(h.name, h.address if self.slurm is None else self.slurm.login,
                                      role=None if self.slurm is None else "login",
                                      usd_per_hour=h.usd_per_hour))
            for h in config.hosts}
        self.shards: dict[int, ShardSlot] = {}
        self.placements: list[Placement] = []
        self.num_shards = 0
        self.plan: protocol.Plan | None = None
        self._closing = False
        self.starved = 0.0                  # seconds the decide loop ran late lately (decaying max)
        self._decider: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.notifier = Notifier(config.spec.notify, config.base_dir, lambda m: self.on_log(m)) \
            if config.spec.notify else None

    # --- setup ---------------------------------------------------------------------------------
    async def deploy(self) -> tuple[list[deploy.Preflight], dict[str, HostError]]:
        """Upload and preflight every host in parallel; returns results and the hosts that failed
        (HostUnusable: reachable but unable to run the worker; other HostErrors: unreachable)."""
        for link in self.links.values():
            link.host.reachable = None
        results = await asyncio.gather(
            *(deploy.deploy_host(l.transport, self.config, l.spec, self.on_log) for l in self.links.values()),
            return_exceptions=True)
        ok, failures = [], {}
        for link, r in zip(self.links.values(), results):
            if isinstance(r, HostError):
                failures[link.spec.name] = r
                link.host.reachable, link.host.error = False, str(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                ok.append(r)
                link.host.reachable = True
        return ok, failures

    async def settle_plan(self, results: list[deploy.Preflight], replan: bool = False) -> protocol.Plan:
        """The run's plan after deploy: the one the hosts hold if fleet.toml still agrees with it,
        else a refusal (PlanError) naming the differences — or, with `replan` and nothing live, a
        new one. Every host gets the plan that is used."""
        base = results[0]
        for r in results[1:]:
            diffs = differences(base.identity, r.identity)
            if diffs:
                raise PlanError(f"{r.host}'s model or data differs from {base.host}'s: " + "; ".join(diffs))
        desired = make_plan(self.config, {r.host: r.gpus for r in results}, base.identity,
                            {r.host: r.report.host_id for r in results})
        held = [r.plan for r in results if r.plan]
        existing = max(held, key=lambda p: p.created) if held else None
        plan, replaced = desired, False
        if existing is not None:
            diffs = plan_differences(existing, desired)
            if not diffs:
                plan = existing
            elif not replan:
                raise PlanError(refusal(existing, diffs))
            else:
                live = await self.live_shards()
                if live:
                    raise PlanError(f"--replan needs every shard stopped; live: {', '.join(live)} "
                                    f"(fleet down first)")
                self.on_log("replanned: " + "; ".join(diffs))
                replaced = True
        await asyncio.gather(*(self._write_plan(self.links[r.host], plan, replaced) for r in results
                               if r.plan != plan))
        self.use_plan(plan)
        return plan

    async def _write_plan(self, link: HostLink, plan: protocol.Plan, replaced: bool) -> None:
        argv = deploy.python_argv(self.config, link.spec, "plan", "write", "--run-dir",
                                  self.config.run_dir(link.spec), *(["--archive-records"] if replaced else []))
        r = await link.transport.run(argv, timeout=60, input=plan.to_json().encode())
        if r.rc != 0:
            raise PlanError(f"{link.spec.name}: cannot write the run's plan: {deploy.last_line(r.stderr)}")

    def use_plan(self, plan: protocol.Plan) -> None:
        """Take the shard layout from the run's plan and create the shard records."""
        check_hosts(plan, self.config)
        self.plan = plan
        self.placements = placements(plan)
        self.num_shards = plan.num_shards
        for link in self.links.values():
            link.placements = [p for p in self.placements if p.host == link.spec.name]
        self.shards = {p.shard: self._new_slot(p) for p in self.placements}

    def _another_machine(self, link: HostLink, host_id: str | None) -> str | None:
        """The plan's machine for this host name is not the one that answered (names swapped in
        fleet.toml): nothing is done there, by any command."""
        planned = self.plan.host_ids.get(link.spec.name) if self.plan else None
        if planned and host_id and planned != host_id:
            return (f"{link.spec.name} is another machine: the plan's {link.spec.name} is {planned}, this "
                    f"one is {host_id} (names swapped or an address changed in fleet.toml?); nothing done there")
        return None

    async def live_shards(self) -> list[str]:
        """'id (host:gpu)' of every shard whose process is alive, on every reachable host."""
        probe = Supervisor(self.config)
        try:
            snap = await probe.read_once()
        finally:
            await probe.close()
        return [f"{s.id} ({s.host}:{s.gpu})" for s in snap.shards if s.alive]

    def _new_slot(self, p: Placement) -> ShardSlot:
        return ShardSlot(p, ShardRecord(needs_done_sentinel=self.policy.needs_done_sentinel))

    # --- judging -------------------------------------------------------------------------------
    def verdict(self, slot: ShardSlot, now: float | None = None) -> Verdict:
        host = self.links[slot.placement.host].host
        now = time.time() if now is None else now
        return judge(slot.record, slot.alive, host.host_now(now), self.policy,
                     tuple(slot.launch_failures), slot.slurm, slot.acting, self.idle(slot))

    @staticmethod
    def idle(slot: ShardSlot) -> float | None:
        """Seconds since the shard's last progress on monotonic clocks (the host's, then ours):
        a step of either wall clock changes nothing. None: not reported (the record's stamps rule)."""
        if slot.idle_s is None or not slot.alive:
            return None
        return slot.idle_s + max(time.monotonic() - slot.idle_at, 0.0)

    def snapshot(self, now: float | None = None) -> FleetSnapshot:
        now = time.time() if now is None else now
        views = [ShardView(s.id, s.placement.host, s.placement.gpu, s.record, self.verdict(s, now),
                           s.alive, s.pid, self.sup.max_restarts, gpus=s.placement.all_gpus,
                           idle_s=self.idle(s))
                 for s in sorted(self.shards.values(), key=lambda s: s.id)]
        hosts = {n: l.host for n, l in self.links.items()}
        if self.slurm is not None:
            hosts.update(self._slurm_views(views))
        return build_snapshot(self.config.run.name, views, hosts, now, self.config.spec.expected)

    def _slurm_views(self, views: list[ShardView]) -> dict[str, HostView]:
        """A Slurm shard shows its node (and the first GPU Slurm gave it) once its launch started;
        the nodes become hosts carrying the GPUs their live tasks report."""
        tasks = []
        for v in views:
            slot, a = self.shards[v.id], v.record.attempt
            v.slurm = slurm_task(v.record, slot.slurm)
            node = (a.node or (v.slurm.node if v.slurm else None)) if a is not None else None
            if not node:
                continue
            v.node, v.gpu = node, (a.gpus[0] if a.gpus else v.gpu)
            v.gpus = tuple(a.gpus) if a.gpus else v.gpus
            live = slot.alive and not a.ended and slot.gpus is not None and slot.gpus.launch == a.n
            tasks.append((node, slot.gpus if live else None))
        return slurm_nodes(self.links[self.config.hosts[0].name].host, tasks)

    @property
    def acting(self) -> bool:
        """An action (a launch, a submission, a restart) is in flight: its record is not in yet."""
        return any(s.busy_since is not None for s in self.shards.values())

    @property
    def replayed(self) -> bool:
        """Every host's agent has replayed its record, or the host is known unreachable."""
        return all_replayed(l.host for l in self.links.values())

    # --- one-shot reading (status, restart, logs) ------------------------------------------------
    async def read_once(self) -> FleetSnapshot:
        """Connect to every host, replay its record once, return the snapshot (same judge, no
        actions). Shards come from the run's plan (any reachable host's; so shards of unreachable
        hosts are listed too), or from the records found when the run has no plan."""
        self.shards, self.placements, self.num_shards, self.plan = {}, [], 0, None
        for link in self.links.values():
            link.placements = []

        async def one(link: HostLink) -> list[str]:
            try:
                await link.transport.connect()
                r = await link.transport.run(self._agent_argv(link, once=True), timeout=120)
                lines = r.stdout.splitlines()
                hello = protocol.parse_message(lines[0]) if lines else None
                if isinstance(hello, protocol.Hello) and hello.plan:
                    plans.append(deploy.parse_reply(protocol.Plan, hello.plan, f"{link.spec.name}: the agent's plan"))
                if r.rc != 0 and not any('"type":"error"' in l for l in lines):
                    raise HostUnusable(deploy._python_missing(self.config, link.spec, r.stderr) or
                                       f"{link.spec.name}: the agent failed there ({self.config.python(link.spec)}, "
                                       f"exit {r.rc}): {deploy.last_line(r.stderr)}")
                return lines
            except HostError as e:
                self._host_down(link, e)
                return []
        plans: list[protocol.Plan] = []
        outputs = await asyncio.gather(*(one(l) for l in self.links.values()))
        if plans:
            self.use_plan(max(plans, key=lambda p: p.created))
        for link, lines in zip(self.links.values(), outputs):
            try:
                if lines:                       # before the messages: one may say what went wrong
                    link.host.reachable, link.host.error, link.host.unusable = True, None, False
                for line in lines:
                    self._handle(link, line, discover=not plans)
            except HostError as e:
                self._host_down(link, e)
        return self.snapshot()

    def _host_down(self, link: HostLink, e: HostError) -> None:
        """The host cannot be read: unreachable, or reached but unusable (its python, its agent)."""
        link.host.reachable, link.host.error = False, str(e).removeprefix(f"{link.spec.name}: ")
        link.host.unusable = isinstance(e, HostUnusable)

    def _discover(self, link: HostLink, k: int, ev: protocol.Record) -> ShardSlot | None:
        """A shard found on a host (status, restart, logs): its first record, the launch, names its GPU."""
        if not isinstance(ev, protocol.Launch):
            return None
        place = Placement(k, link.spec.name, ev.gpu if ev.gpu is not None else -1)
        self.placements.append(place)
        link.placements.append(place)
        self.num_shards = len(self.placements)
        slot = self.shards[k] = self._new_slot(place)
        return slot

    # --- following -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Open every host's agent stream and start carrying out verdicts."""
        for link in self.links.values():
            link.task = asyncio.create_task(self._host_loop(link), name=f"host-{link.spec.name}")
        self._decider = asyncio.create_task(self._decide_loop(), name="decide")
        if self.notifier is not None:
            self.notifier.start(self.snapshot, lambda: self.replayed)

    async def wait_replayed(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.replayed:
            await asyncio.sleep(0.05)

    async def launch_all(self) -> None:
        """Launch every shard that is neither live nor done (what `fleet up` does on (re)attach):
        a manual launch, so failed, FATAL and stopped shards start over with a fresh budget; one
        command per host (with [slurm]: one array of all of them)."""
        await self.wait_replayed()
        due: dict[str, list[protocol.ShardAction]] = {}
        for s in self.shards.values():
            link = self.links[s.placement.host]
            if link.host.reachable and s.busy_since is None and not s.alive and \
                    self.verdict(s).state not in LIVE | {State.DONE, State.QUEUED}:
                self._busy(s)
                a = user_action(s.record, "restart", self.sup.stop_grace, s.id)
                due.setdefault(link.spec.name, []).append(a)
        await asyncio.gather(*(self.carry_out(self.links[h], acts) for h, acts in due.items()))

    def silence_limit(self, link: HostLink) -> float:
        """How long an agent may be silent before its host counts as unreachable: longer while the
        host is busy with actions of ours (eight launches at once load a small host for seconds),
        and while this process itself is starved of CPU (its own loop running late): silence it
        could not have heard is not the host's."""
        busy = sum(1 for s in self.shards.values()
                   if s.placement.host == link.spec.name and (s.busy_since is not None or s.acting or
                                                               s.last_state in STARTING_UP))
        return min(60.0, AGENT_SILENCE_S + SILENCE_PER_ACTION_S * busy + 8 * self.starved)

    def _agent_argv(self, link: HostLink, once: bool = False) -> list[str]:
        shards = "auto" if once else ",".join(str(p.shard) for p in link.placements) or "auto"
        args = ["--run-dir", self.config.run_dir(link.spec), "--shards", shards,
                "--output", self.config.host_path(link.spec, self.config.run.output),
                "--interval", str(self.sup.telemetry_interval)]
        args += self.launcher.agent_args()
        if once:
            args.append("--once")
        return deploy.python_argv(self.config, link.spec, "agent", *args)

    async def _host_loop(self, link: HostLink) -> None:
        delay = 1.0
        while not self._closing:
            try:
                await link.transport.connect()
                link.diagnostics.clear()
                link.stream = await link.transport.stream(self._agent_argv(link))
                lines = link.stream.lines().__aiter__()
                while not self._closing:
                    try:
                        silence = self.silence_limit(link)
                        if not link.host.replayed:          # the agent is starting and replaying
                            silence = max(silence, AGENT_START_S)
                        line = await asyncio.wait_for(lines.__anext__(), silence)
                    except StopAsyncIteration:
                        why = link.diagnostics[-1] if link.diagnostics else "no output"
                        raise HostError(f"{link.spec.name}: agent exited: {why}") from None
                    except asyncio.TimeoutError:
                        raise HostError(f"{link.spec.name}: no telemetry for {silence:.0f}s") from None
                    if isinstance(self._handle(link, line), protocol.Beat):
                        delay = 1.0                  # healthy for a while: reconnect fast next time
                    if link.host.reachable is not True and link.host.replayed:
                        link.host.reachable, link.host.error, link.host.unusable = True, None, False
                        self.on_log(f"{link.spec.name}: connected")
                        self.on_change()
            except HostError as e:
                if self._closing:
                    break
                was = link.host.reachable
                self._host_down(link, e)
                link.host.replayed = False
                if was is not False:
                    self.on_log(f"{link.spec.name}: {'unusable' if link.host.unusable else 'unreachable'}: "
                                f"{link.host.error}")
                self.on_change()
                await self._drop_stream(link, drop_connection=True)
            except asyncio.CancelledError:
                break
            except Exception as e:                      # a bug must not silently stop a host's loop
                link.host.reachable, link.host.error = False, f"{type(e).__name__}: {e}"
                link.host.replayed = False
                self.on_log(f"{link.spec.name}: supervisor error: {link.host.error}")
                self.on_change()
                await self._drop_stream(link, drop_connection=True)
            if self._closing:
                break
            link.wake.clear()
            try:
                await asyncio.wait_for(link.wake.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, self.sup.reconnect_max)

    async def _drop_stream(self, link: HostLink, drop_connection: bool) -> None:
        if link.stream is not None:
            try:
                await asyncio.wait_for(link.stream.close(), 3)
            except Exception:
                pass
            link.stream = None
        if drop_connection:
            try:
                await asyncio.wait_for(link.transport.close(), 3)
            except Exception:
                pass

    def _reset_host(self, link: HostLink) -> None:
        """A new stream replays everything: this host's shards start from a clean record (what
        only the supervisor knows, actions in flight and failed launches, is kept)."""
        for p in link.placements:
            old = self.shards.get(p.shard)
            fresh = self._new_slot(p)
            if old is not None:
                fresh.launch_failures, fresh.busy_since = old.launch_failures, old.busy_since
                fresh.busy_mark, fresh.last_state = old.busy_mark, old.last_state
            self.shards[p.shard] = fresh
        link.host.replayed = False

    def _handle(self, link: HostLink, line: str, discover: bool = False) -> protocol.Message | None:
        msg = protocol.parse_message(line)
        if msg is None:                         # not a message: a diagnostic (a traceback line)
            if line.strip():
                link.diagnostics.append(line.strip()[-300:])
            return None
        now = time.time()
        host = link.host
        host.last_seen = now
        t = getattr(msg, "t", None)
        if t is not None:
            host.clock_offset = float(t) - now
        if isinstance(msg, protocol.Hello):
            if msg.protocol != protocol.PROTOCOL_VERSION:
                raise HostError(f"{link.spec.name}: host runs worker protocol {msg.protocol}, this "
                                f"fleet speaks {protocol.PROTOCOL_VERSION}: redeploy (fleet up)")
            if (why := self._another_machine(link, msg.host_id)) is not None:
                raise HostUnusable(f"{link.spec.name}: {why}")
            if not discover:
                self._reset_host(link)
        elif isinstance(msg, protocol.EventMessage):
            ev = protocol.parse_event(msg.event)
            if ev is None:
                return msg
            slot = self.shards.get(msg.shard)
            if slot is None:
                slot = self._discover(link, msg.shard, ev) if discover else None
                if slot is None:
                    return msg
            slot.record.apply(ev)
            if isinstance(ev, protocol.Launch):
                slot.launch_failures.clear()
                slot.alive = None            # liveness read before this launch says nothing of it
            if isinstance(ev, protocol.PROGRESS_EVENTS) and host.replayed:     # followed live: it is news
                slot.idle_s, slot.idle_at = 0.0, time.monotonic()
        elif isinstance(msg, protocol.Liveness):
            slot = self.shards.get(msg.shard)
            if slot is not None:
                slot.alive, slot.pid, slot.acting = msg.alive, msg.pid, msg.acting
                slot.idle_s, slot.idle_at = msg.idle_s, time.monotonic()
        elif isinstance(msg, protocol.SlurmTask):
            slot = self.shards.get(msg.shard)
            if slot is not None:
                slot.slurm = msg
        elif isinstance(msg, protocol.TaskGpus):
            slot = self.shards.get(msg.shard)
            if slot is not None:
                slot.gpus = msg
        elif isinstance(msg, protocol.SlurmPoll):
            host.error = f"Slurm: {msg.error}" if msg.error else None
        elif isinstance(msg, protocol.GpuReading):
            host.telemetry, host.gpus, host.gpu_t = msg.source, msg.gpus or [], msg.t
        elif isinstance(msg, protocol.DiskReading):
            host.disk = {"path": msg.path, "free": msg.free, "total": msg.total, "error": msg.error}
        elif isinstance(msg, protocol.Replayed):
            host.replayed = True
            self.on_change()
        elif isinstance(msg, protocol.AgentError):
            raise HostError(f"{link.spec.name}: agent failed: {msg.message}")
        return msg

    # --- carrying out verdicts -------------------------------------------------------------------
    async def _decide_loop(self) -> None:
        while not self._closing:
            try:
                self.decide(time.time())
            except Exception as e:                      # keep supervising whatever happens
                self.on_log(f"supervisor error: {type(e).__name__}: {e}")
            t0 = time.monotonic()
            await asyncio.sleep(0.25)
            late = time.monotonic() - t0 - 0.25         # how starved this process is (a loaded machine)
            self.starved = max(late, self.starved * 0.95)

    def decide(self, now: float) -> None:
        """One pass: judge every shard of a reachable, replayed host and carry out what is due,
        one `act` per host for everything due there now."""
        changed = False
        due: dict[str, list[protocol.ShardAction]] = {}
        for s in list(self.shards.values()):
            link = self.links[s.placement.host]
            self._settle_busy(s, now)
            v = self.verdict(s, now)
            if v.state != s.last_state:
                s.last_state, changed = v.state, True
            if not link.host.reachable or not link.host.replayed or s.busy_since is not None:
                continue
            action = policy_action(s.record, v, self.sup.stop_grace, s.id)
            if action is not None:
                self._busy(s, now)
                due.setdefault(link.spec.name, []).append(action)
        for host, actions in due.items():
            self._spawn(self.carry_out(self.links[host], actions))
        if changed:
            self.on_change()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _busy(self, s: ShardSlot, now: float | None = None) -> None:
        s.busy_since, s.busy_mark = (time.time() if now is None else now), busy_mark(s.record)

    def _settle_busy(self, s: ShardSlot, now: float) -> None:
        """An action is over once the record shows what it did (a new launch, a new intent), or,
        the outcome never showing up, after ACTION_TIMEOUT_S: the verdict decides again, and the
        host refuses a second launch of what it already did (`expect_launch`)."""
        if s.busy_since is not None and (busy_mark(s.record) != s.busy_mark or
                                         now - s.busy_since > ACTION_TIMEOUT_S):
            s.busy_since = None

    async def carry_out(self, link: HostLink, actions: list[protocol.ShardAction],
                        wait: float = 0.0) -> list[protocol.ActResult]:
        """Send actions to one host's launcher. A command that could not run there is a failed
        launch for every launch or restart in it (counted by the judge); a command that timed out
        says nothing: the record does, and the verdict decides again."""
        places = {p.shard: p for p in link.placements}
        try:
            results = await self.launcher.act(link.transport, link.spec, actions, places, self.num_shards, wait)
        except HostError as e:
            why = str(e).removeprefix(f"{link.spec.name}: ")
            unusable = isinstance(e, HostUnusable)
            for a in actions:
                s = self.shards[a.shard]
                s.busy_since = None
                if unusable and a.kind != "stop":
                    s.launch_failures.append(LaunchFailure(link.host.host_now(time.time()), a.by, why))
            self.on_log(f"shards {_ids([a.shard for a in actions])}: {actions[0].kind} failed: {why}")
            self.on_change()
            return [protocol.ActResult(shard=a.shard, status="error", detail=str(e)) for a in actions]
        told: dict[tuple, list[int]] = {}
        asked = {a.shard: a for a in actions}
        for r in results:
            s = self.shards.get(r.shard)
            if s is not None and r.status not in UNDER_WAY:
                s.busy_since = None          # nothing was done (stale, busy, refused): judge again
            a = asked.get(r.shard)
            told.setdefault((a.kind if a else "act", a.by if a else "", r.status, r.detail), []).append(r.shard)
        for (kind, by, status, detail), ids in told.items():   # one line per outcome: a submission is one
            who = f"shard {ids[0]} ({self._where(ids[0])})" if len(ids) == 1 else f"shards {_ids(ids)}"
            self.on_log(f"{who}: {kind} ({by}): {status}" + (f": {detail}" if detail else ""))
        return results

    def _where(self, shard_id: int) -> str:
        s = self.shards.get(shard_id)
        return f"{s.placement.host}:{s.placement.gpu}" if s is not None else "?"

    # --- the user's actions (the TUI's keys, fleet restart / down) -------------------------------
    def refusal(self, shard_id: int, kind: str) -> str | None:
        """Why this action cannot apply to this shard now (the same rule for every caller)."""
        s = self.shards.get(shard_id)
        if s is None:
            return f"no shard {shard_id}"
        return action_refusal(kind, self.verdict(s).state, shard_id)

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
            self._busy(s)
            by_host.setdefault(s.placement.host, []).append(user_action(s.record, kind, self.sup.stop_grace, k))
        results = await asyncio.gather(*(self.carry_out(self.links[h], acts, wait) for h, acts in by_host.items()))
        for batch in results:
            out.update((r.shard, r) for r in batch)
        return dict(sorted(out.items()))

    async def stop_all(self, timeout: float | None = None) -> dict[str, dict]:
        """`fleet down` / D: a run stop of every shard on every host, whatever its state (a shard
        waiting for a restart, or never launched, is STOPPED too); waits for each to be carried out.
        Returns, per host, shard -> status, or {"error": ...} for a host that could not be reached."""
        grace = self.sup.stop_grace if timeout is None else timeout
        if not self.shards:                      # a one-shot command: the plan's shards, or the records'
            await self.read_once()

        async def one(link: HostLink) -> tuple[str, dict]:
            try:
                await link.transport.connect()
            except HostError as e:
                return link.spec.name, {"error": str(e)}
            ids = [p.shard for p in link.placements]
            if not ids:
                return link.spec.name, {}
            actions = [protocol.ShardAction(shard=k, kind="stop", why="run", grace=grace) for k in ids]
            results = await self.carry_out(link, actions, wait=grace + 30)
            if results and all(r.status == "error" for r in results):
                return link.spec.name, {"error": results[0].detail or "error"}
            return link.spec.name, {str(r.shard): (r.detail or r.status) for r in results}
        return dict(await asyncio.gather(*(one(l) for l in self.links.values())))

    async def log_lines(self, shard_id: int, last: int = 200, follow: bool = True):
        """A shard's log: its last `last` lines, then (`follow`) new ones until the stream ends.
        Raises HostError when the host cannot be read."""
        link = self.links[self.shards[shard_id].placement.host]
        argv = self.launcher.log_argv(link.spec, shard_id, last, follow)
        if not follow:
            for line in (await link.transport.run(argv)).stdout.splitlines():
                yield line
            return
        stream = await link.transport.stream(argv)
        try:
            async for line in stream.lines():
                if not line.startswith("tail: "):       # tail's own chatter ("has appeared; following")
                    yield line.rstrip("\n")
        finally:
            await stream.close()

    def resolve_shard(self, ref: str) -> int:
        """'3' or 'host:gpu' -> shard id (KeyError with a message otherwise)."""
        if ref.isascii() and ref.isdigit() and int(ref) in self.shards:     # '¹'.isdigit() too
            return int(ref)
        if ":" in ref:
            host, _, gpu = ref.rpartition(":")
            for s in self.shards.values():
                if s.placement.host == host and str(s.placement.gpu) == gpu:
                    return s.id
        known = ", ".join(f"{s.id} ({s.placement.host}:{s.placement.gpu})"
                          for s in self.shards.values()) or "none"
        raise KeyError(f"no shard {ref!r}; shards: {known}")

    async def close(self) -> None:
        """Stop following (telling what just changed first); the workers keep running."""
        if self.notifier is not None:
            await self.notifier.close()
        self._closing = True
        tasks = [l.task for l in self.links.values() if l.task] + list(self._tasks)
        if self._decider:
            tasks.append(self._decider)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in self.links.values():
            await self._drop_stream(link, drop_connection=True)


def _ids(ids: list[int]) -> str:
    return ",".join(map(str, ids)) if len(ids) <= 8 else f"{ids[0]}..{ids[-1]} ({len(ids)})"
