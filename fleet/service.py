"""The run's supervisor as a service that outlives its clients (issue 52): SkyPilot's API server,
supervisord and tmux's server, for one run.

`fleet serve` (in the foreground: a systemd unit, a tmux window, a head node) or `fleet up` (in
the background, when none runs for its fleet.toml) starts it. It holds the run's lock on this
machine and the run's claim on its hosts (worker/claim.py), deploys and preflights every host
that answers, settles the plan, launches what `fleet up` launches, and then supervises — restarts,
stalls, moves of rows between hosts, `[notify]`, `--metrics` — whether or not anyone watches.
Clients (`fleet up`'s view and `--headless`, `status`, `down`, `restart`, `logs`) talk to it over
its control socket (fleet/control.py; owner-only, fleet/runhome.py says where), act through its
supervisor's one door, and see one state. It goes by itself once the run has ended (finished, or
every shard settled with nothing in flight) and its last client has gone; `fleet serve --stop`
ends it sooner. Ending it never stops a worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections import deque
from typing import Callable, TextIO
from wsgiref.simple_server import WSGIServer

from pydantic import BaseModel

from . import control, render
from .bundle import worker_hash
from .config import Config
from .runhome import RunHome, SupervisorInfo, config_digest, user_name
from .schema import FleetSnapshot
from .setup import EXIT_CONFIG, EXIT_FAULT, EXIT_UNREACHABLE, SetupRefused
from .source import SupervisorSource
from .store import Transition
from .supervisor import Supervisor
from .transport import HostError

from worker import protocol

PUSH_S = 1.0              # a watching client (or a /metrics scrape) gets the newest picture this often,
PUSH_LARGE_S = 2.0        # or this often in a run of more than LARGE_RUN shards (a picture of 512 shards
LARGE_RUN = 256           # a second was a quarter of the supervisor's CPU at 64 hosts); a transition at once
UNWATCHED_S = 5.0         # with neither, whether the run has ended is asked this often, and at each transition
LINGER_S = 0.0            # an ended run's supervisor waits this long with no client before it goes
FAILED_LINGER_S = 30.0    # a refused setup waits this long for the client that started it to read why
QUEUE_MAX = 20000         # a client this far behind is dropped (it reconnects)
NOTES_KEPT = 50           # the supervisor's last log lines a new client gets


def push_every(shards: int) -> float:
    """Seconds between the pictures a watched supervisor pushes when nothing changes state."""
    return PUSH_S if shards <= LARGE_RUN else PUSH_LARGE_S


class Peer:
    """One client connection: the messages to send it in order (a newer picture replaces one
    not yet sent: a slow client skips stale pictures, never a transition), and whether it watches."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.queue: deque[tuple[str, bytes]] = deque()
        self.wake = asyncio.Event()
        self.watching = False
        self.closed = False

    def send(self, record: BaseModel | bytes, kind: str = "") -> None:
        if self.closed:
            return
        data = record if isinstance(record, bytes) else control.encode(record)
        if kind == "snap":
            self.queue = deque(item for item in self.queue if item[0] != "snap")
        self.queue.append((kind, data))
        if len(self.queue) > QUEUE_MAX:
            self.close()
        self.wake.set()

    async def pump(self) -> None:
        try:
            while not self.closed:
                await self.wake.wait()
                self.wake.clear()
                while self.queue:
                    self.writer.write(self.queue.popleft()[1])
                    await self.writer.drain()
        except (ConnectionError, OSError):
            self.close()

    def close(self) -> None:
        self.closed = True
        self.wake.set()
        self.writer.close()


class Service:
    """One run's supervisor and its clients."""

    def __init__(self, config: Config, home: RunHome, replan: bool = False, allow_partial: bool = False,
                 metrics: str | None = None, take_over: bool = False, width: int | None = None,
                 echo: Callable[[str], None] | None = None):
        self.config = config
        self.home = home
        self.replan, self.allow_partial, self.take_over = replan, allow_partial, take_over
        self.metrics_address = metrics
        self.width = width
        self.echo = echo
        self.phase = "setup"
        self.peers: set[Peer] = set()
        self.said: list[bytes] = []                       # setup's output, for every client that joins
        self.notes: deque[str] = deque(maxlen=NOTES_KEPT)
        self.failed: control.Failed | None = None
        self.failed_read = False                          # a client has been sent why setup failed
        self.stopping = asyncio.Event()
        self.wake = asyncio.Event()
        self.ready = asyncio.Event()                      # setup is over (supervising, or failed)
        self.newest: FleetSnapshot | None = None
        self.fresh: FleetSnapshot | None = None       # the picture a decide pass's changes just pushed
        self.metrics_server: WSGIServer | None = None
        self.t0 = time.monotonic()
        self.log_file: TextIO | None = None
        self.sup: Supervisor | None = None
        self.source: SupervisorSource | None = None
        self.info: SupervisorInfo | None = None

    @property
    def supervisor(self) -> Supervisor:
        """The run's supervisor: made in _run before the control socket serves a client or a
        decide pass can run, so every caller below finds it."""
        assert self.sup is not None, "the supervisor is made in _run before anything asks for it"
        return self.sup

    # --- what it says ---------------------------------------------------------------------------
    def log(self, line: str) -> None:
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}"
        if self.log_file is not None:
            self.log_file.write(stamped + "\n")
            self.log_file.flush()
        if self.echo is not None:
            self.echo(stamped)

    def say(self, text: str) -> None:
        """Setup's output (what `fleet up` printed before): logged, kept, and sent to the watchers."""
        for line in text.splitlines():
            self.log(line)
        record = control.encode(control.Say(text=text))
        self.said.append(record)
        self.broadcast(record)

    def step(self, text: str) -> None:
        self.say(f"  {time.monotonic() - self.t0:5.1f}s  {text}")

    def note(self, text: str) -> None:
        """The supervisor's own log line (a launch, a move, a host lost)."""
        self.log(text)
        self.notes.append(text)
        self.broadcast(control.encode(control.Note(text=text)))

    def broadcast(self, data: bytes, kind: str = "") -> None:
        for peer in list(self.peers):
            if peer.watching:
                peer.send(data, kind)

    def changed(self, changes: list[Transition]) -> None:
        """A decide pass's transitions: the picture after them, then the lines `--headless` prints."""
        snap = self.newest = self.fresh = self.supervisor.snapshot()
        lines = render.transition_lines(changes, snap)
        for line in lines:
            self.log(line)
        self.wake.set()                                   # (the run may have ended with them)
        if any(p.watching for p in self.peers):          # (the changes first: a picture that ends the
            self.broadcast(control.encode(control.Changes(       # run ends `--headless` after its lines)
                transitions=[control.TransitionRecord.of(c) for c in changes], lines=lines)))
            self.broadcast(self.snap_record(snap), "snap")

    def snap_record(self, snap: FleetSnapshot, request_id: int = 0) -> bytes:
        ended = self.phase == "supervising" and self.supervisor.run_ended(snap)
        return control.encode(control.Snap(id=request_id, phase=self.phase, ended=ended,
                                           snapshot=snap.model_copy(update={"supervisor": self.where()})))

    def where(self) -> str | None:
        return self.info.where() + f"; log {self.home.log}" if self.info is not None else None

    # --- its life -----------------------------------------------------------------------------
    async def run(self) -> int:
        """Supervise until the run has ended and no client is left, or until told to stop;
        the exit code of a refused setup, else 0."""
        lock = self.home.hold()
        if lock is None:
            other = self.home.info()
            raise SetupRefused(f"run {self.config.run.name} is already supervised here"
                               + (f" ({other.where()})" if other else "")
                               + ": `fleet up` joins it, `fleet serve --stop` stops it", EXIT_FAULT)
        try:
            return await self._run()
        finally:
            os.close(lock)

    async def _run(self) -> int:
        home, config = self.home, self.config
        log_file = self.log_file = open(home.log, "a", buffering=1)
        started = round(time.time(), 3)
        self.info = SupervisorInfo(run=config.run.name, pid=os.getpid(), machine=socket.gethostname(),
                                   user=user_name(), started=started, config=config.path,
                                   config_digest=config_digest(config.path), bundle=worker_hash(),
                                   socket=home.socket, log=home.log, metrics=self.metrics_address)
        claim = protocol.SupervisorClaim(id=self.info.id, run=config.run.name, machine=self.info.machine,
                                         user=self.info.user, pid=self.info.pid, started=started,
                                         config=config.path, socket=home.socket)
        sup = self.sup = Supervisor(config, claim=claim, take_over=self.take_over, allow_partial=self.allow_partial)
        self.source = SupervisorSource(sup, on_log=self.note)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(home.socket)                       # (we hold the lock: a socket there is stale)
        old = os.umask(0o177)
        try:
            server = await asyncio.start_unix_server(self.serve_peer, path=home.socket, limit=1 << 20)
        finally:
            os.umask(old)
        os.chmod(home.socket, 0o600)
        home.write_info(self.info)
        self.log(f"supervising run {config.run.name} ({config.path}) as pid {os.getpid()}; socket {home.socket}")
        code: int | None = None
        try:
            code = await self._supervise()
        finally:
            server.close()
            for peer in list(self.peers):
                peer.close()
            with contextlib.suppress(OSError):
                os.unlink(home.socket)
            with contextlib.suppress(OSError):
                os.unlink(home.info_path)
            if self.metrics_server is not None:
                self.metrics_server.shutdown()
                self.metrics_server.server_close()
            await sup.close()
            self.log(f"stopped supervising ({f'exit {code}' if code is not None else 'on the error below'}); "
                     "the workers keep running")
            log_file.close()
        return code

    async def _supervise(self) -> int:
        sup = self.supervisor
        try:
            await sup.prepare(self.say, self.step, self.replan, self.width)
        except SetupRefused as e:
            return await self.refuse(str(e), e.code)
        except HostError as e:                            # a plan that cannot be written, say
            return await self.refuse(str(e), EXIT_UNREACHABLE)
        if self.metrics_address and (why := self.serve_metrics(self.metrics_address)):
            return await self.refuse(why, EXIT_CONFIG)
        sup.subscribe(self.changed)
        await sup.start()
        self.phase = "launching"
        waits = [asyncio.ensure_future(sup.wait_replayed()), asyncio.ensure_future(sup.claimed_event.wait())]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if sup.claimed is not None:
            return await self.refuse(claimed_words(self.config, sup.claimed.holder, self.take_over), EXIT_FAULT)
        await sup.launch_all()
        self.phase = "supervising"
        self.ready.set()
        return await self._watch()

    async def _watch(self) -> int:
        """Push pictures to the watchers; go once the run has ended and no client is left."""
        sup = self.supervisor
        ended_since = None
        while not self.stopping.is_set():
            if sup.claimed is not None:
                return await self.refuse(claimed_words(self.config, sup.claimed.holder, self.take_over), EXIT_FAULT)
            fresh, self.fresh = self.fresh, None          # (pushed with its changes: not built twice)
            snap = self.newest = fresh or sup.snapshot()
            if fresh is None and any(p.watching for p in self.peers):
                self.broadcast(self.snap_record(snap), "snap")
            if sup.run_ended(snap):
                ended_since = ended_since or time.monotonic()
                if not self.peers and time.monotonic() - ended_since >= LINGER_S:
                    self.note(f"run {self.config.run.name} has ended: {render.finished_summary(snap) if snap.totals.finished else 'nothing more to do'}")
                    return 0
            else:
                ended_since = None
            self.wake.clear()
            watched = self.metrics_server is not None or any(p.watching for p in self.peers)
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(push_every(len(sup.shards)) if watched else UNWATCHED_S):
                    await self.wake.wait()
        self.note("told to stop supervising")
        return 0

    async def refuse(self, message: str, code: int) -> int:
        """Setup (or the run's claim) refused: say why to every client, and wait a little for the
        one that started this supervisor to read it."""
        self.phase = "failed"
        self.failed = control.Failed(message=message, code=code)
        self.log(f"error: {message}")
        self.failed_read = any(p.watching for p in self.peers)
        self.broadcast(control.encode(self.failed))
        self.ready.set()
        deadline = time.monotonic() + FAILED_LINGER_S
        while time.monotonic() < deadline and not self.stopping.is_set() and not self.failed_read:
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.2)                          # (its pump writes the line)
        return code

    def serve_metrics(self, address: str) -> str | None:
        """/metrics on `address` for the run's life, from the picture the loop takes every second;
        the reason it cannot serve there, or None."""
        from .metrics import AddressError, serve
        if self.metrics_server is not None:
            return None if address == self.metrics_address else \
                f"--metrics: this supervisor serves {self.metrics_address} already"
        try:
            self.metrics_server = serve(address, lambda: self.newest)
        except (OSError, AddressError) as e:
            return f"--metrics {address}: cannot serve there: {e}"
        self.metrics_address = address
        if self.info is not None:
            self.info.metrics = address
            self.home.write_info(self.info)
        self.note(f"metrics: http://{address}/metrics")
        return None

    # --- one client -----------------------------------------------------------------------------
    async def serve_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Peer(writer)
        self.peers.add(peer)
        pump = asyncio.ensure_future(peer.pump())
        tasks: set[asyncio.Task] = set()
        try:
            while not peer.closed:
                try:
                    line = await reader.readline()
                except (ConnectionError, ValueError):       # gone, or a line past the limit
                    break
                if not line:
                    break
                try:
                    request = control.parse_request(line)
                except control.ControlError as e:
                    peer.send(control.Reply(id=0, error=f"not a request: {e}", code=EXIT_CONFIG))
                    continue
                task = asyncio.ensure_future(self.answer(peer, request))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            for task in tasks:
                task.cancel()
            peer.close()
            pump.cancel()
            self.peers.discard(peer)
            self.wake.set()

    async def answer(self, peer: Peer, req: control.Request) -> None:
        try:
            await self._answer(peer, req)
        except asyncio.CancelledError:
            raise
        except Exception as e:                            # a bug answers as an error, never ends the service
            self.log(f"supervisor error answering {type(req).__name__}: {type(e).__name__}: {e}")
            peer.send(control.Reply(id=req.id, error=f"supervisor error: {type(e).__name__}: {e}", code=EXIT_FAULT))

    async def _answer(self, peer: Peer, req: control.Request) -> None:
        sup, source, info = self.supervisor, self.source, self.info
        assert source is not None and info is not None, "both are made in _run before the socket serves"
        if isinstance(req, control.Hello):
            peer.send(control.Welcome(id=req.id, run=info.run, phase=self.phase, pid=info.pid, machine=info.machine,
                                      user=info.user, started=info.started, config=info.config,
                                      config_digest=info.config_digest, bundle=info.bundle, log=info.log,
                                      metrics=self.metrics_address))
        elif isinstance(req, control.Watch):
            if self.phase in ("setup", "launching", "failed"):    # setup's lines, to a client that waits on it
                for data in self.said:
                    peer.send(data)
            for text in self.notes:
                peer.send(control.Note(text=text, past=True))
            peer.watching = True
            self.wake.set()                               # (pictures every PUSH_S from now)
            if self.failed is not None:
                peer.send(self.failed)
                self.failed_read = True
            else:
                peer.send(self.snap_record(sup.snapshot()), "snap")
        elif isinstance(req, control.SnapshotRequest):
            peer.send(self.snap_record(sup.snapshot(), req.id), "snap")
        elif isinstance(req, control.HistoryRequest):
            peer.send(control.Reply(id=req.id, history=source.history_now(req.step, max(1, min(req.points, 4000)))))
        elif isinstance(req, control.Shutdown):
            peer.send(control.Reply(id=req.id, data="stopping"))
            self.stopping.set()
        elif isinstance(req, control.Metrics):
            why = self.serve_metrics(req.address)
            peer.send(control.Reply(id=req.id, error=why, code=EXIT_CONFIG if why else 0))
        elif not await self._ready_for(peer, req):
            return
        elif isinstance(req, control.Up):
            await sup.launch_all()                        # (pictures from here on know of its launches)
            peer.send(control.Reply(id=req.id, data=time.time()))
        elif isinstance(req, control.Act):
            try:
                ids = [sup.resolve_shard(ref) for ref in req.shards]
            except KeyError as e:
                peer.send(control.Reply(id=req.id, error=str(e.args[0]), code=EXIT_CONFIG))
                return
            results = await sup.request(ids, req.kind, wait=req.wait)
            peer.send(control.Reply(id=req.id, acted=[control.ActOutcome.of(r) for r in results.values()]))
        elif isinstance(req, control.StopAll):
            stops = await sup.stop_all(req.timeout)
            peer.send(control.Reply(id=req.id, stopped=[control.HostStopRecord(host=h.host, shards=h.shards, error=h.error)
                                                        for h in stops]))
        elif isinstance(req, control.Log):
            await self._log(peer, req)

    async def _ready_for(self, peer: Peer, req: control.Request) -> bool:
        """Actions wait for setup to be over; after a refused setup they are refused with its reason."""
        await self.ready.wait()
        if self.failed is not None:
            peer.send(control.Reply(id=req.id, error=self.failed.message, code=self.failed.code))
            return False
        return True

    async def _log(self, peer: Peer, req: control.Log) -> None:
        sup = self.supervisor
        try:
            k = sup.resolve_shard(req.shard)
        except KeyError as e:
            peer.send(control.Reply(id=req.id, error=str(e.args[0]), code=EXIT_CONFIG))
            return
        host = sup.store.hosts[sup.shards[k].placement.host]
        if host.reachable is False:
            peer.send(control.Reply(id=req.id, error=host.error or f"{host.name}: unreachable", code=EXIT_UNREACHABLE))
            return
        try:
            async with contextlib.aclosing(sup.log_lines(k, req.last, req.follow)) as lines:
                async for line in lines:                  # (closed at once when the client goes)
                    peer.send(control.LogLine(id=req.id, text=line))
                    if peer.closed:
                        return
        except HostError as e:
            peer.send(control.Reply(id=req.id, error=str(e), code=EXIT_UNREACHABLE))
            return
        peer.send(control.Reply(id=req.id))


def claimed_words(config: Config, holder: protocol.SupervisorClaim | None, took_over: bool) -> str:
    """Why a second supervisor of the run refuses, and where the first is."""
    if holder is None or not holder.machine or holder.machine == "?":
        who = "another supervisor (its agent holds the run on a host, but its claim cannot be read)"
    else:
        info = SupervisorInfo(run=holder.run, pid=holder.pid, machine=holder.machine, user=holder.user,
                              started=holder.started, config=holder.config, config_digest="", bundle="",
                              socket=holder.socket, log="")
        who = f"the supervisor {info.where()} (fleet.toml {holder.config})"
    here = holder is not None and holder.machine == socket.gethostname()
    join = "`fleet up -c " + holder.config + "` joins it" if here and holder else \
        f"join it there, or with `fleet up --at {holder.user}@{holder.machine}` from here" if holder else "join it"
    return (f"run {config.run.name} is supervised by {who}: {join}; `fleet serve --stop` there ends it. If it is "
            f"gone (its machine off or asleep), its hold lapses within 5 minutes of its last word"
            + ("" if took_over else ", or `fleet up --take-over` takes the run now"))


def serve_forever(config: Config, home: RunHome, echo: Callable[[str], None] | None, **options) -> int:
    """`fleet serve`: run the service in this process until it ends; its exit code."""
    service = Service(config, home, echo=echo, **options)
    try:
        return asyncio.run(service.run())
    except SetupRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
