"""Following one host: its agent stream kept open (reconnecting with capped exponential backoff),
every line folded into the store, and the one-shot read that `status`, `restart` and `logs` use.

A new stream replays the host's records from the start into fresh records, so the picture after a
reconnect or a supervisor restart is the host's own record, never a guess. A host is unreachable
after a silence longer than the supervisor's limit for it (`silence`): longer while it is busy with
our actions or while this process is starved of CPU.

Every wait here is bounded with `asyncio.timeout`, never `asyncio.wait_for`: Python 3.11's
wait_for returns a line that lands in the same loop pass as a cancel and drops the cancel, and a
follow loop that reads on keeps `Supervisor.close` waiting for ever (tests/fleet/test_follow.py).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from worker import protocol
from worker.text import plain_json, printable, printable_data, printable_lines

from . import deploy, render
from .config import Config, HostSpec
from .engine import Launcher
from .state import State
from .hosts import Host
from .store import Store
from .transport import HostError, HostUnusable, RunClaimed, Stream, Transport

AGENT_START_S = 30.0          # a new agent stream: its Python start and replay, on a loaded host
PING_S = 10.0                 # a line to a claiming agent's stdin this often (worker/claim.py)
UNUSABLE_RETRY_S = 120.0      # a host that answered but cannot be used is tried again after this
AGENT_SILENCE_S = 5.0         # no line from an agent for this long: the host is unreachable...
LATE_S = 0.5                  # a wait that ends this much past its time: this process ran late
SILENCE_PER_ACTION_S = 2.0    # ...plus this per shard starting or acted on there (a launch storm)
STARTING_UP = frozenset({State.STARTING, State.LOADING, State.STOPPING})
SILENCE_CHECK_S = 0.5         # the host's silence is looked at (and its limit worked out) this often


@dataclass
class HostLink:
    spec: HostSpec
    transport: Transport
    store: Store
    launcher: Launcher
    starved: Callable[[], float]                      # how late the supervisor's own loop runs
    on_log: Callable[[str], None]
    on_change: Callable[[], None]
    stream: Stream | None = None
    task: asyncio.Task | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    diagnostics: deque = field(default_factory=lambda: deque(maxlen=5))
    delay: float = 1.0                                # before the next reconnect
    claim: protocol.SupervisorClaim | None = None     # hold the run on the host for this supervisor
    take_over: bool = False                           # ...ending the agent of the one holding it
    unprepared: bool = False                          # not deployed and preflighted yet (it did not answer)
    prepare: Callable[[HostLink], Awaitable[None]] | None = None   # does that once it answers
    on_claimed: Callable[[RunClaimed], None] = lambda e: None      # another supervisor holds the run
    pinged: float = 0.0
    heard_at: float = 0.0                             # (loop time) the agent's last line

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def host(self) -> Host:
        return self.store.hosts[self.spec.name]

    async def agent_argv(self, once: bool = False) -> list[str]:
        config = self.store.config
        shards = "auto" if once else ",".join(str(p.shard) for p in self.store.on(self.name)) or "auto"
        args = ["--run-dir", config.run_dir(self.spec), "--shards", shards,
                "--output", config.output_dir(self.spec),
                "--interval", str(config.spec.supervise.telemetry_interval), *self.launcher.agent_args()]
        if once:
            args.append("--once")
        elif self.claim is not None:
            args += ["--claim", self.claim.to_json()] + (["--take-over"] if self.take_over else [])
        return await deploy.worker_argv(self.transport, config, self.spec, "agent", *args)

    def silence(self) -> float:
        """How long the agent may be silent before its host counts as unreachable: longer while the
        host is busy with actions of ours (eight launches at once load a small host for seconds),
        and while the supervisor itself is starved of CPU (its own loop running late): silence it
        could not have heard is not the host's."""
        shown, shards = self.store.shown, self.store.shards
        busy = sum(1 for p in self.store.on(self.name) if (s := shards.get(p.shard)) is not None and
                   (s.busy_since is not None or s.acting or shown.get(s.id, (None,))[0] in STARTING_UP))
        return min(60.0, AGENT_SILENCE_S + SILENCE_PER_ACTION_S * busy + 8 * self.starved())

    def take(self, line: str, discover: bool = False) -> protocol.Message | None:
        """One line of the agent: a message folded into the store, or a diagnostic kept."""
        msg = protocol.parse_message(line) if plain_json(line) else \
            protocol.parse_message(line, printable_data)       # a host's text is data, never control
        if msg is None:                         # not a message: a diagnostic (a traceback line)
            if line.strip():
                self.diagnostics.append(printable(line.strip())[-300:])
            return None
        ev = self.store.apply(self.name, msg, discover)
        if isinstance(ev, protocol.Leased) and isinstance(msg, protocol.EventMessage) and self.host.replayed and \
                (said := render.lease_line(ev, msg.shard, self.store.where, self.store.published_state)) is not None:
            self.on_log(said)                   # a move as it happens (not the replay's history; an
                                                # event comes of an EventMessage alone)
        if isinstance(msg, protocol.Replayed):
            self.on_change()
        return msg

    def down(self, e: HostError) -> None:
        was = self.host.reachable
        self.host.down(e)
        if was is not False:
            self.on_log(f"{self.name}: {'unusable' if self.host.unusable else 'unreachable'}: {self.host.error}")
        self.on_change()

    async def follow(self) -> None:
        """Keep the agent stream open until cancelled."""
        while True:
            try:
                await self.transport.connect()
                self.diagnostics.clear()
                if self.unprepared and self.prepare is not None:
                    await self.prepare(self)
                    self.unprepared = False
                self.stream = await self.transport.stream(await self.agent_argv())
                await self._read(self.stream.lines().__aiter__())
            except RunClaimed as e:                     # another supervisor's run: stop here
                await self.drop()
                self.on_claimed(e)
                return
            except HostError as e:
                self.down(e)
                await self.drop()
                if isinstance(e, HostUnusable):         # its python, its preflight: not fixed in seconds
                    self.delay = max(self.delay, UNUSABLE_RETRY_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:                      # a bug must not silently stop a host's loop
                self.host.down(HostError(f"{self.name}: {type(e).__name__}: {e}"))
                self.on_log(f"{self.name}: supervisor error: {self.host.error}")
                self.on_change()
                await self.drop()
            self.wake.clear()
            try:
                async with asyncio.timeout(self.delay):
                    await self.wake.wait()
            except asyncio.TimeoutError:
                pass
            self.delay = min(self.delay * 2, self.store.config.spec.supervise.reconnect_max)

    async def _read(self, lines) -> None:
        """Fold the agent's lines until it goes silent for longer than `silence` — silence of the
        host's, not ours: one task reads and folds every line as it comes, and this one looks at
        the silence every SILENCE_CHECK_S (a timer a line was a third of the supervisor's CPU at
        64 hosts); a look that came long after its time (this process was stopped or starved)
        starts the silence over, so nothing it could not have heard counts against the host."""
        loop = asyncio.get_running_loop()
        self.heard_at = loop.time()
        reader = asyncio.ensure_future(self._fold_all(lines))
        try:
            while True:
                t0 = loop.time()
                done, _ = await asyncio.wait({reader}, timeout=SILENCE_CHECK_S)
                if done:
                    reader.result()                 # (the agent exited: its HostError)
                now = loop.time()
                if now - t0 > SILENCE_CHECK_S + LATE_S:
                    self.heard_at = now             # our lateness, not the host's silence
                    continue
                silence = self.silence()
                if not self.host.replayed:          # the agent is starting and replaying
                    silence = max(silence, AGENT_START_S)
                if now - self.heard_at > silence:
                    raise HostError(f"{self.name}: no telemetry for {silence:.0f}s")
        finally:
            reader.cancel()

    async def _fold_all(self, lines) -> None:
        loop = asyncio.get_running_loop()
        async for line in lines:
            self.heard_at = loop.time()
            self._fold(line)
        why = self.diagnostics[-1] if self.diagnostics else "no output"
        raise HostError(f"{self.name}: agent exited: {why}")

    def _fold(self, line: str) -> None:
        """One line of the live stream folded; the host is up once its record is replayed."""
        if isinstance(self.take(line), protocol.Beat):
            self.delay = 1.0                     # healthy for a while: reconnect fast next time
            now = asyncio.get_running_loop().time()
            if self.claim is not None and self.stream is not None and now - self.pinged >= PING_S:
                self.pinged = now
                self.stream.ping()
        if self.host.reachable is not True and self.host.replayed:
            self.host.up()
            self.on_log(f"{self.name}: connected")
            self.on_change()

    async def drop(self, connection: bool = True) -> None:
        if self.stream is not None:
            try:
                async with asyncio.timeout(3):
                    await self.stream.close()
            except Exception:
                pass
            self.stream = None
        if connection:
            try:
                async with asyncio.timeout(3):
                    await self.transport.close()
            except Exception:
                pass

    async def lines(self, argv: list[str], follow: bool):
        """The lines a command prints (a shard's log): all at once, or (`follow`) as they come
        until the stream ends, without tail's own chatter ("has appeared; following")."""
        if not follow:
            for line in printable_lines((await self.transport.run(argv)).stdout):
                yield line
            return
        stream = await self.transport.stream(argv)
        try:
            async for line in stream.lines():
                if not line.startswith("tail: "):
                    yield printable(line.rstrip("\n"))
        finally:
            await stream.close()

    async def read_once(self, config: Config) -> list[str]:
        """The agent's whole replay, once (`--once`); [] when the host cannot be read."""
        try:
            await self.transport.connect()
            r = await self.transport.run(await self.agent_argv(once=True), timeout=120)
            lines = r.stdout.splitlines()
            if r.rc != 0 and not any('"type":"error"' in l for l in lines):
                raise HostUnusable(deploy._python_missing(config, self.spec, r.stderr) or
                                   f"{self.name}: the agent failed there ({config.python(self.spec)}, "
                                   f"exit {r.rc}): {deploy.last_line(r.stderr)}")
            return lines
        except HostError as e:
            self.host.down(e)
            return []


def hello_plan(line: str, host: str) -> protocol.Plan | None:
    """The run's plan an agent's hello carries, if any; one that is no plan is a HostUnusable
    naming the host (where the live stream would only pass the line over)."""
    try:
        d = json.loads(line)
    except ValueError:
        return None
    if isinstance(d, dict) and d.get("type") == protocol.Hello.KIND and d.get("plan"):
        return deploy.parse_reply(protocol.Plan, d["plan"], f"{host}: the agent's plan")
    return None


async def read_all(store: Store, links: dict[str, HostLink], config: Config) -> None:
    """Connect to every host and replay its record once into the store. Shards come from the
    run's plan (any reachable host's; so shards of unreachable hosts are listed too), or from the
    records found when the run has no plan."""
    store.forget()
    outputs = await asyncio.gather(*(link.read_once(config) for link in links.values()))
    plans = []
    for link, lines in zip(links.values(), outputs):
        try:
            if lines and (plan := hello_plan(lines[0], link.name)) is not None:
                plans.append(plan)
        except HostError as e:
            link.host.down(e)
    if plans:
        store.use_plan(max(plans, key=lambda p: p.created))
    for link, lines in zip(links.values(), outputs):
        try:
            if lines:                       # before the messages: one may say what went wrong
                link.host.up()
            for line in lines:
                link.take(line, discover=not plans)
        except HostError as e:
            link.host.down(e)
