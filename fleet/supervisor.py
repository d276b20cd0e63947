"""The supervisor: connects to every host, deploys, launches shards, follows each host's agent and
applies the restart policy. No UI: the CLI's headless mode and the TUI both drive it and read its
snapshots.

Each host has one task that keeps an agent stream open (reconnecting with capped exponential
backoff). A new stream replays the host's events from the start into fresh Shard objects, so the
picture after a reconnect or a supervisor restart is the host's own record, never a guess.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

from worker import protocol

from . import deploy
from .config import Config, HostSpec
from .jobs import Placement, place_shards, sentinel_spec, shard_command, shard_dir
from .state import (LIVE, TERMINAL, Host, Shard, State, backoff_delay, build_snapshot, next_action)
from .transport import HostError, Stream, Transport, make_transport

AGENT_SILENCE_S = 5.0         # no line from an agent for this long: the host is unreachable


@dataclass
class HostLink:
    spec: HostSpec
    transport: Transport
    host: Host
    placements: list[Placement] = field(default_factory=list)
    replayed: bool = False
    stream: Stream | None = None
    task: asyncio.Task | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Supervisor:
    def __init__(self, config: Config, on_change: Callable[[], None] | None = None,
                 on_log: Callable[[str], None] | None = None):
        self.config = config
        self.sup = config.spec.supervise
        self.on_change = on_change or (lambda: None)
        self.on_log = on_log or (lambda msg: None)
        slots = asyncio.Semaphore(self.sup.max_concurrent_connects)
        self.links: dict[str, HostLink] = {
            h.name: HostLink(h, make_transport(h, self.sup, slots), Host(h.name, h.address))
            for h in config.hosts}
        self.shards: dict[int, Shard] = {}
        self.placements: list[Placement] = []
        self.num_shards = 0
        self._launching: set[int] = set()
        self._closing = False
        self._decider: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    # --- setup ---------------------------------------------------------------------------------
    async def deploy(self) -> tuple[list[deploy.Preflight], dict[str, str]]:
        """Upload and preflight every host in parallel; returns results and unreachable hosts."""
        for link in self.links.values():
            link.host.reachable = None
        results = await asyncio.gather(
            *(deploy.deploy_host(l.transport, self.config, l.spec) for l in self.links.values()),
            return_exceptions=True)
        ok, failures = [], {}
        for link, r in zip(self.links.values(), results):
            if isinstance(r, HostError):
                failures[link.spec.name] = str(r).removeprefix(f"{link.spec.name}: ")
                link.host.reachable, link.host.error = False, str(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                ok.append(r)
                link.host.reachable = True
        return ok, failures

    def plan(self, gpus_by_host: dict[str, list[int]]) -> None:
        """Fix the shard layout (one per GPU) and create the shard records."""
        self.placements = place_shards(self.config, gpus_by_host)
        self.num_shards = len(self.placements)
        for link in self.links.values():
            link.placements = [p for p in self.placements if p.host == link.spec.name]
        self.shards = {p.shard: self._new_shard(p) for p in self.placements}

    def _new_shard(self, p: Placement) -> Shard:
        job = self.config.spec.job
        return Shard(p.shard, p.host, p.gpu, needs_done_sentinel=bool(job and job.done))

    # --- one-shot reading (status) --------------------------------------------------------------
    async def read_once(self) -> dict:
        """Connect to every host, replay its record once, judge it (settle), return the snapshot.
        Each call starts from a clean record: the hosts' events are the whole truth."""
        self.shards, self.placements, self.num_shards = {}, [], 0
        for link in self.links.values():
            link.placements = []
        async def one(link: HostLink) -> None:
            try:
                await link.transport.connect()
                r = await link.transport.run(self._agent_argv(link, once=True), timeout=120)
                if r.rc != 0:
                    raise HostError(f"{link.spec.name}: agent failed: {r.stderr.strip()[-300:]}")
                link.host.reachable, link.host.error = True, None
                for line in r.stdout.splitlines():
                    self._handle(link, line, discover=True)
            except HostError as e:
                link.host.reachable, link.host.error = False, str(e)
        await asyncio.gather(*(one(l) for l in self.links.values()))
        self.settle()
        return self.snapshot()

    def _discover(self, link: HostLink, k: int, ev: dict) -> Shard:
        """A shard found on a host (status, restart, logs): its first event, LAUNCH, names its GPU."""
        place = Placement(k, link.spec.name, int(ev["gpu"]) if ev.get("gpu") is not None else -1)
        self.placements.append(place)
        link.placements.append(place)
        self.num_shards = len(self.placements)
        shard = self.shards[k] = self._new_shard(place)
        return shard

    # --- following -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Open every host's agent stream and start the decision loop."""
        for link in self.links.values():
            link.task = asyncio.create_task(self._host_loop(link), name=f"host-{link.spec.name}")
        self._decider = asyncio.create_task(self._decide_loop(), name="decide")

    async def wait_replayed(self, timeout: float = 60) -> None:
        """Until every reachable host's agent has replayed its record (or is known unreachable)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(l.replayed or l.host.reachable is False for l in self.links.values()):
                return
            await asyncio.sleep(0.05)

    async def launch_all(self) -> None:
        """Launch every shard that is neither live nor done (what `fleet up` does on (re)attach)."""
        await self.wait_replayed()
        jobs = []
        for s in self.shards.values():
            link = self.links[s.host]
            if link.host.reachable and s.state not in LIVE and s.state != State.DONE and not s.alive:
                jobs.append(self.launch(s.id, by="manual"))
        await asyncio.gather(*jobs)

    def _agent_argv(self, link: HostLink, once: bool = False) -> list[str]:
        shards = "auto" if once else ",".join(str(p.shard) for p in link.placements) or "auto"
        args = ["--run-dir", self.config.run_dir(link.spec), "--shards", shards,
                "--output", self.config.host_path(link.spec, self.config.run.output),
                "--interval", str(self.sup.telemetry_interval)]
        if spec := sentinel_spec(self.config, link.spec):
            args += ["--sentinels", json.dumps(spec)]
        if once:
            args.append("--once")
        return deploy.python_argv(self.config, link.spec, "agent", *args)

    async def _host_loop(self, link: HostLink) -> None:
        delay = 1.0
        while not self._closing:
            try:
                await link.transport.connect()
                link.stream = await link.transport.stream(self._agent_argv(link))
                link.replayed = False
                lines = link.stream.lines().__aiter__()
                first = True
                while not self._closing:
                    try:
                        line = await asyncio.wait_for(lines.__anext__(), AGENT_SILENCE_S)
                    except StopAsyncIteration:
                        raise HostError(f"{link.spec.name}: agent stream ended") from None
                    except asyncio.TimeoutError:
                        raise HostError(f"{link.spec.name}: no telemetry for {AGENT_SILENCE_S:.0f}s") from None
                    if first:
                        self._reset_host(link)
                        first = False
                    self._handle(link, line)
                    if link.host.reachable is not True:
                        link.host.reachable, link.host.error = True, None
                        self.on_log(f"{link.spec.name}: connected")
                    delay = 1.0
            except HostError as e:
                if self._closing:
                    break
                was = link.host.reachable
                link.host.reachable, link.host.error = False, str(e).removeprefix(f"{link.spec.name}: ")
                link.replayed = False
                if was is not False:
                    self.on_log(f"{link.spec.name}: unreachable: {link.host.error}")
                self.on_change()
                await self._drop_stream(link, drop_connection=True)
            except asyncio.CancelledError:
                break
            except Exception as e:                      # a bug must not silently stop a host's loop
                link.host.reachable, link.host.error = False, f"{type(e).__name__}: {e}"
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
        """A new stream replays everything: start this host's shards from a clean record."""
        for p in link.placements:
            old = self.shards.get(p.shard)
            fresh = self._new_shard(p)
            if old is not None and old.backoff_until is not None:
                fresh.backoff_until = old.backoff_until
            self.shards[p.shard] = fresh

    def _handle(self, link: HostLink, line: str, discover: bool = False) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        now = time.time()
        link.host.last_seen = now
        kind = msg.get("type")
        if "t" in msg and kind in ("hello", "beat", "gpu", "shard", "replayed"):
            link.host.clock_offset = float(msg["t"]) - now
        if kind == "event":
            k = int(msg["shard"])
            shard = self.shards.get(k)
            ev = msg["event"]
            if shard is None:
                if not discover:
                    return
                shard = self._discover(link, k, ev)
            if ev.get("event") == protocol.LAUNCH:
                self._launching.discard(k)
                if ev.get("gpu") is not None:
                    shard.gpu = int(ev["gpu"])
            before = shard.state
            shard.apply(ev)
            if shard.state != before:
                self.on_change()
        elif kind == "shard":
            shard = self.shards.get(int(msg["shard"]))
            if shard is not None:
                before = shard.state
                shard.set_alive(bool(msg["alive"]), msg.get("pid"))
                if shard.state != before:
                    self.on_change()
        elif kind == "gpu":
            link.host.telemetry = msg.get("source")
            link.host.gpus = msg.get("gpus") or []
            link.host.gpu_t = msg.get("t")
        elif kind == "disk":
            link.host.disk = {k: msg.get(k) for k in ("path", "free", "total", "error")}
        elif kind == "replayed":
            link.replayed = True
            self.on_change()

    # --- decisions -----------------------------------------------------------------------------
    async def _decide_loop(self) -> None:
        while not self._closing:
            try:
                self.decide(time.time())
            except Exception as e:                      # keep supervising whatever happens
                self.on_log(f"supervisor error: {type(e).__name__}: {e}")
            await asyncio.sleep(0.25)

    def decide(self, now: float) -> None:
        """One pass of the policy: stalls, backoff timers, restarts, FATAL."""
        for s in list(self.shards.values()):
            link = self.links[s.host]
            if not link.host.reachable or not link.replayed or s.id in self._launching:
                continue
            before = s.state
            s.check_stall(link.host.host_now(now), self.sup.stall_timeout)
            if s.state == State.BACKOFF:
                if s.backoff_until is not None and now >= s.backoff_until:
                    self._spawn(self.relaunch(s.id, by="auto"))
            else:
                action = next_action(s, self.sup.max_restarts, self.sup.restart_stalled)
                if action == "fatal":
                    self._make_fatal(s)
                elif action == "restart":
                    delay = backoff_delay(s.auto_attempts, self.sup.backoff_base, self.sup.backoff_max)
                    s.backoff_until = s.backoff_until if s.backoff_until and s.backoff_until > now \
                        else now + delay
                    s.reason = f"{s.reason}; restart in {delay:.0f}s"
                    s.state = State.BACKOFF
            if s.state != before:
                self.on_change()

    def settle(self, now: float | None = None) -> None:
        """For one-shot reads (status): stalls and FATAL as the live policy would judge them."""
        now = time.time() if now is None else now
        for s in self.shards.values():
            link = self.links[s.host]
            if not link.host.reachable:
                continue
            s.check_stall(link.host.host_now(now), self.sup.stall_timeout)
            if next_action(s, self.sup.max_restarts, self.sup.restart_stalled) == "fatal":
                self._make_fatal(s)

    def _make_fatal(self, s: Shard) -> None:
        s.state = State.FATAL
        s.reason = f"gave up after {self.sup.max_restarts} restart(s); last: {s.reason}"

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- actions -------------------------------------------------------------------------------
    async def launch(self, shard_id: int, by: str = "manual") -> dict:
        s = self.shards[shard_id]
        link = self.links[s.host]
        place = next(p for p in self.placements if p.shard == shard_id)
        cmd = shard_command(self.config, link.spec, place, self.num_shards)
        args = ["launch", "--shard-dir", shard_dir(self.config, link.spec, shard_id),
                "--attempt", str(s.auto_attempts + 1 if by == "auto" else 0), "--by", by,
                "--gpu", str(place.gpu)]
        for k, v in cmd.env.items():
            args += ["--env", f"{k}={v}"]
        if cmd.cwd:
            args += ["--cwd", cmd.cwd]
        self._launching.add(shard_id)
        try:
            result = await deploy.run_worker_module(link.transport, self.config, link.spec, "hostctl",
                                                    *args, "--", *cmd.argv, timeout=60)
        except HostError as e:
            self._launching.discard(shard_id)
            self.on_log(f"shard {shard_id}: launch failed: {e}")
            return {"status": "error", "error": str(e)}
        if result.get("status") != "started":
            self._launching.discard(shard_id)
        s.backoff_until = None
        self.on_log(f"shard {shard_id} ({s.host}:{s.gpu}): launch ({by}): {result.get('status')}")
        return result

    async def stop(self, shard_id: int, timeout: float = 10) -> dict:
        s = self.shards[shard_id]
        link = self.links[s.host]
        try:
            return await deploy.run_worker_module(
                link.transport, self.config, link.spec, "hostctl", "stop", "--shard-dir",
                shard_dir(self.config, link.spec, shard_id), "--timeout", str(timeout), timeout=timeout + 30)
        except HostError as e:
            return {"status": "error", "error": str(e)}

    async def relaunch(self, shard_id: int, by: str = "manual") -> dict:
        """Restart a shard: stop it if it still runs, then launch; it resumes from its manifest."""
        s = self.shards[shard_id]
        self._launching.add(shard_id)            # the policy leaves it alone meanwhile
        if s.alive:
            await self.stop(shard_id)
        return await self.launch(shard_id, by=by)

    async def stop_all(self, timeout: float = 10) -> dict[str, dict]:
        async def one(link: HostLink) -> tuple[str, dict]:
            try:
                await link.transport.connect()
                return link.spec.name, await deploy.run_worker_module(
                    link.transport, self.config, link.spec, "hostctl", "stop-all", "--run-dir",
                    self.config.run_dir(link.spec), "--timeout", str(timeout), timeout=timeout + 60)
            except HostError as e:
                return link.spec.name, {"error": str(e)}
        return dict(await asyncio.gather(*(one(l) for l in self.links.values())))

    def resolve_shard(self, ref: str) -> int:
        """'3' or 'host:gpu' -> shard id (KeyError with a message otherwise)."""
        if ref.isdigit() and int(ref) in self.shards:
            return int(ref)
        if ":" in ref:
            host, _, gpu = ref.rpartition(":")
            for s in self.shards.values():
                if s.host == host and str(s.gpu) == gpu:
                    return s.id
        known = ", ".join(f"{s.id} ({s.host}:{s.gpu})" for s in self.shards.values()) or "none"
        raise KeyError(f"no shard {ref!r}; shards: {known}")

    # --- reading -------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        return build_snapshot(self.config.run.name, sorted(self.shards.values(), key=lambda s: s.id),
                              {n: l.host for n, l in self.links.items()}, time.time(),
                              self.config.spec.expected)

    def all_terminal(self) -> bool:
        return bool(self.shards) and all(
            s.state in TERMINAL or (s.state == State.FAILED and s.stopped) for s in self.shards.values())

    async def close(self) -> None:
        """Stop following; the workers keep running."""
        self._closing = True
        tasks = [l.task for l in self.links.values() if l.task] + list(self._tasks)
        if self._decider:
            tasks.append(self._decider)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for link in self.links.values():
            await self._drop_stream(link, drop_connection=True)
