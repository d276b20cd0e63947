"""A client of the run's supervisor (fleet/service.py): joining the one that runs for a fleet.toml,
or starting it in the background, and the live view's source over its control socket.

Everything a command prints about the run comes from the supervisor's one picture: `fleet up`
(view or headless), `status`, `down`, `restart` and `logs` join it in a second, with no deploy and
no SSH of their own. Starting one is `fleet serve` in its own session (so a closed terminal or a
quit view never ends it), its output into its log (fleet/runhome.py says where).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from collections import deque
from typing import AsyncIterator, Awaitable, Callable, Protocol

from pydantic import BaseModel

from worker.text import last_line

from . import control
from .actions import HostStop, describe, refusal
from .bundle import worker_hash
from .config import Config
from .runhome import RunHome, config_digest
from .schema import FleetSnapshot
from .store import Transition
from .transport import HostError

START_S = 60.0           # a supervisor started in the background answers on its socket by then


class SupervisorGone(Exception):
    """The connection to the supervisor closed (it stopped, or was killed)."""


class RequestFailed(Exception):
    """The supervisor refused a request: its one line, and the exit code a command gives it."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class Reader(Protocol):
    """What a Client reads the supervisor from: a unix socket's StreamReader, or an SSH bridge's stdout."""

    async def readline(self) -> bytes: ...


class Writer(Protocol):
    """What a Client writes its requests to: a unix socket's StreamWriter, or an SSH bridge's stdin."""

    def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...

    async def wait_closed(self) -> None: ...


class Client:
    """One connection to the run's supervisor. Replies reach the request that asked (by id);
    everything else the supervisor sends (setup's lines, notes, pictures, transitions) goes to
    `pushes`, in order, or to `on_push` once one is set."""

    def __init__(self, reader: Reader, writer: Writer):
        self.reader, self.writer = reader, writer
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future] = {}
        self.lines: dict[int, asyncio.Queue] = {}
        self.pushes: asyncio.Queue = asyncio.Queue()
        self.on_push: Callable[[BaseModel | None], None] | None = None     # None: the connection closed
        self.gone: str | None = None
        self.task = asyncio.ensure_future(self._read())

    @classmethod
    async def connect(cls, path: str) -> Client | None:
        """A connection to the supervisor listening at `path`; None when none listens there."""
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=1 << 26)
        except OSError:
            return None
        return cls(reader, writer)

    async def _read(self) -> None:
        try:
            while line := await self.reader.readline():
                try:
                    msg = control.parse_message(line)
                except control.ControlError:
                    continue
                rid = getattr(msg, "id", 0)
                if isinstance(msg, control.LogLine) and rid in self.lines:
                    self.lines[rid].put_nowait(msg)
                elif rid and rid in self.lines:                     # the end of a log
                    self.lines[rid].put_nowait(msg)
                elif rid and rid in self.waiting:
                    self.waiting.pop(rid).set_result(msg)
                elif self.on_push is not None:
                    self.on_push(msg)
                else:
                    self.pushes.put_nowait(msg)
        except (OSError, ValueError) as e:
            self.gone = str(e)
        finally:
            self.gone = self.gone or "the supervisor closed the connection"
            for fut in self.waiting.values():
                if not fut.done():
                    fut.set_exception(SupervisorGone(self.gone))
            self.waiting.clear()
            for q in self.lines.values():
                q.put_nowait(None)
            self.pushes.put_nowait(None)
            if self.on_push is not None:
                self.on_push(None)

    def send(self, req: control.Request) -> int:
        if self.gone is not None:
            raise SupervisorGone(self.gone)
        req.id = req.id or next(self.ids)
        self.writer.write(control.encode(req))
        return req.id

    async def ask(self, req: control.Request):
        """Send `req` and wait for its answer (a Reply, a Welcome, a Snap). Raises SupervisorGone."""
        fut = asyncio.get_running_loop().create_future()
        rid = next(self.ids)
        self.waiting[rid] = fut
        req.id = rid
        try:
            self.send(req)
        except SupervisorGone:
            self.waiting.pop(rid, None)
            raise
        return await fut

    async def stream(self, req: control.Log) -> AsyncIterator[str]:
        """A shard's log lines as the supervisor sends them, until the end; an error ends it as
        RequestFailed (the supervisor's words and exit code)."""
        rid = next(self.ids)
        q: asyncio.Queue = asyncio.Queue()
        self.lines[rid] = q
        req.id = rid
        self.send(req)
        try:
            while True:
                msg = await q.get()
                if msg is None:
                    raise SupervisorGone(self.gone or "gone")
                if isinstance(msg, control.LogLine):
                    yield msg.text
                    continue
                if isinstance(msg, control.Reply) and msg.error:
                    raise RequestFailed(msg.error, msg.code)
                return
        finally:
            self.lines.pop(rid, None)

    async def next_push(self):
        """The next thing the supervisor sent unasked; SupervisorGone once it has closed."""
        msg = await self.pushes.get()
        if msg is None:
            self.pushes.put_nowait(None)
            raise SupervisorGone(self.gone or "gone")
        return msg

    async def close(self) -> None:
        self.task.cancel()
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (OSError, asyncio.CancelledError):
            pass


# --- joining or starting the run's supervisor ----------------------------------------------------

async def join(home: RunHome, config: Config, who: str) -> tuple[Client, control.Welcome] | None:
    """The supervisor that runs for this fleet.toml here, greeted; None when none answers."""
    client = await Client.connect(home.socket)
    if client is None:
        return None
    try:
        welcome = await client.ask(control.Hello(client=who, config_digest=config_digest(config.path), bundle=worker_hash()))
    except SupervisorGone:
        await client.close()
        return None
    return client, welcome


def differs(welcome: control.Welcome, config: Config) -> str | None:
    """Why the supervisor that runs is not the one this command would start (another fleet.toml
    or another fleet), or None."""
    if welcome.config_digest != config_digest(config.path):
        return "fleet.toml changed since it started"
    if welcome.bundle != worker_hash():
        return "fleet (its worker) changed since it started"
    return None


def spawn(config: Config, options: list[str]) -> subprocess.Popen:
    """`fleet serve` in a session of its own (a closed terminal or a quit view never ends it), its
    output into its log: the run's supervisor in the background."""
    home = RunHome(config.run.name, config.path)
    home.make()
    log = open(home.log, "a")
    try:
        return subprocess.Popen([sys.executable, "-m", "fleet", "serve", "-c", config.path, "--background",
                                 *options], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True, cwd=os.getcwd(), close_fds=True)
    finally:
        log.close()


class StartFailed(Exception):
    """The supervisor started in the background ended before it answered: its log's last line."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


async def start(home: RunHome, config: Config, options: list[str], who: str) -> tuple[Client, control.Welcome]:
    """Start the run's supervisor in the background and join it (another client may have started
    one meanwhile: joined the same). Raises StartFailed."""
    before = os.path.getsize(home.log) if os.path.exists(home.log) else 0
    proc = spawn(config, options)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if (joined := await join(home, config, who)) is not None:
            return joined
        if proc.poll() is not None and not home.held():
            with open(home.log, errors="replace") as f:
                f.seek(before)
                said = [line for line in f.read().splitlines() if line.strip()]
            why = next((l for l in reversed(said) if "error:" in l), said[-1] if said else "no output")
            raise StartFailed(f"the run's supervisor did not start (exit {proc.returncode}): "
                              f"{last_line(why).split('error: ', 1)[-1]} (log: {home.log})", proc.returncode or 1)
        await asyncio.sleep(0.1)
    raise StartFailed(f"the run's supervisor did not answer within {START_S:.0f}s (log: {home.log})", 1)


async def stop(client: Client, home: RunHome, timeout: float = 30.0) -> bool:
    """Ask the supervisor to stop and wait until it has (its lock is free); False if it did not."""
    try:
        await client.ask(control.Shutdown())
    except SupervisorGone:
        pass
    await client.close()
    deadline = time.monotonic() + timeout
    while home.held() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return not home.held()


# --- a supervisor on another machine, over SSH ----------------------------------------------------

# Run on the supervisor's machine with its python (standard library only): finds the run's
# supervisor among its state folders (fleet/runhome.py's layout, by the run's name) and joins this
# process's stdin and stdout to its control socket. What it cannot do, it says as one `failed` line.
BRIDGE = r"""
import glob, json, os, pwd, socket, sys, threading
run = sys.argv[1]
root = os.environ.get("FLEET_STATE_DIR") or os.path.join(
    os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state"), "fleet")
def say(message):
    sys.stdout.write(json.dumps({"type": "failed", "message": message, "code": 1}) + "\n")
    sys.stdout.flush()
    sys.exit(0)
live = []
for path in glob.glob(os.path.join(root, "*", "supervisor.json")):
    try:
        info = json.load(open(path))
        if info.get("run") == run:
            os.kill(int(info["pid"]), 0)
            live.append(info)
    except (OSError, ValueError, KeyError, TypeError):
        pass
here = socket.gethostname()
if not live:
    say("no supervisor of run %s runs on %s (as %s): start one there with `fleet serve -c FLEET.TOML`"
        % (run, here, pwd.getpwuid(os.getuid()).pw_name))
if len(live) > 1:
    say("%d supervisors of run %s run on %s (fleet.toml %s): give the run another name in one of them"
        % (len(live), run, here, ", ".join(i.get("config", "?") for i in live)))
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(live[0]["socket"])
except OSError as e:
    say("the supervisor of run %s on %s does not answer on %s: %s" % (run, here, live[0]["socket"], e))
def up():
    while True:
        data = os.read(0, 65536)
        if not data:
            break
        s.sendall(data)
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
threading.Thread(target=up, daemon=True).start()
while True:
    data = s.recv(65536)
    if not data:
        break
    os.write(1, data)
"""


class _ChannelWriter:
    """A Client's writer over an SSH channel (the bridge's stdin); closing it closes the connection."""

    def __init__(self, stream, transport):
        self.stream, self.transport = stream, transport

    def write(self, data: bytes) -> None:
        self.stream.proc.stdin.write(data)

    def close(self) -> None:
        self.stream.proc.close()

    async def wait_closed(self) -> None:
        await self.transport.close()


class _ChannelReader:
    def __init__(self, stream):
        self.lines = stream.proc.stdout

    async def readline(self) -> bytes:
        return await self.lines.readline()


async def join_at(config: Config, at: str, who: str) -> tuple[Client, control.Welcome]:
    """The run's supervisor on another machine, over SSH: `at` is a [[hosts]] name of fleet.toml
    (its address, keys and python) or an SSH destination ([user@]host[:port], through
    ~/.ssh/config). Raises RequestFailed with the reason it cannot be joined."""
    from .config import HostSpec
    from .transport import make_transport
    spec = next((h for h in config.hosts if h.name == at), None)
    if spec is None:
        user, _, rest = at.rpartition("@")
        address, _, port = rest.partition(":")
        if not address or (port and not port.isdigit()):
            raise RequestFailed(f"--at {at}: not a host of fleet.toml nor [user@]host[:port]", 2)
        spec = HostSpec(name=at, address=address, port=int(port) if port else None, user=user or None)
    if spec.is_local:
        raise RequestFailed(f"--at {at}: that host is this machine; leave --at out", 2)
    transport = make_transport(spec, config.spec.supervise, asyncio.Semaphore(1))
    try:
        await transport.connect()
        stream = await transport.stream([config.python(spec), "-c", BRIDGE, config.run.name])
    except HostError as e:
        raise RequestFailed(str(e), 3) from None
    client = Client(_ChannelReader(stream), _ChannelWriter(stream, transport))
    try:
        welcome = await client.ask(control.Hello(client=who, config_digest=config_digest(config.path),
                                                 bundle=worker_hash()))
    except SupervisorGone:
        said = []
        while not client.pushes.empty():
            said.append(client.pushes.get_nowait())
        await client.close()
        failed = next((m for m in said if isinstance(m, control.Failed)), None)
        raise RequestFailed(f"{at}: " + (failed.message if failed else "the supervisor there closed the connection"),
                            1) from None
    return client, welcome


# --- the live view's source ----------------------------------------------------------------------

class RemoteSource:
    """The live view's FleetSource (fleet/source.py) over the supervisor's socket: the picture it
    pushes, its notes and transitions; actions are requests, refused by the same rule as in the
    supervisor (`actions.refusal` on the state it shows) and judged there again."""

    def __init__(self, client: Client, connect: Callable[[], Awaitable[Client | None]], snap: FleetSnapshot,
                 on_gone: Callable[[str], None] = lambda why: None):
        """`connect`: another connection to the same supervisor (a shard's log has its own)."""
        self.client = client
        self.connect = connect
        self.latest = snap
        self.messages: deque[str] = deque(maxlen=50)
        self.listeners: list[Callable[[list[Transition]], None]] = []
        self.on_gone = on_gone
        client.on_push = self._push
        while not client.pushes.empty():              # what came before the view opened
            if (msg := client.pushes.get_nowait()) is not None:
                self._push(msg)

    def _push(self, msg: BaseModel | None) -> None:
        if msg is None:
            self.on_gone(self.client.gone or "gone")
        elif isinstance(msg, control.Snap):
            self.latest = msg.snapshot
        elif isinstance(msg, control.Note):
            self.messages.append(msg.text)
        elif isinstance(msg, control.Changes):
            changes = [t.transition() for t in msg.transitions]
            for listener in self.listeners:
                listener(changes)
        elif isinstance(msg, control.Failed):
            self.on_gone(msg.message)

    def snapshot(self) -> FleetSnapshot:
        return self.latest

    def subscribe(self, listener: Callable[[list[Transition]], None]) -> None:
        self.listeners.append(listener)

    async def history(self, step: float, points: int) -> list[tuple[float, float, float]]:
        reply = await self.client.ask(control.HistoryRequest(step=step, points=points))
        return [tuple(p) for p in reply.history]

    def refusal(self, shard_id: int, kind: str) -> str | None:
        s = next((s for s in self.latest.shards if s.id == shard_id), None)
        if s is None:
            return f"no shard {shard_id}"
        return refusal(kind, s.state, shard_id, verifiable=self.latest.verifiable, why=s.reason)

    async def _act(self, kind: str, ids: list[int]) -> list[str]:
        reply = await self.client.ask(control.Act(kind=kind, shards=[str(k) for k in ids]))
        if reply.error:
            return [reply.error]
        return [describe(a.result()) for a in reply.acted]

    async def restart(self, ids: list[int]) -> list[str]:
        return await self._act("restart", ids)

    async def stop(self, ids: list[int]) -> list[str]:
        return await self._act("stop", ids)

    async def stop_all(self) -> list[str]:
        reply = await self.client.ask(control.StopAll())
        return [reply.error] if reply.error else [host_stop(h).text() for h in reply.stopped]

    async def follow_log(self, shard_id: int) -> AsyncIterator[str]:
        """The shard's log over a connection of its own (a long log never holds up the picture)."""
        client = await self.connect()
        if client is None:
            raise HostError("the run's supervisor is gone")
        try:
            async for line in client.stream(control.Log(shard=str(shard_id))):
                yield line
        except (SupervisorGone, RequestFailed) as e:
            raise HostError(f"shard {shard_id}: {e}") from None
        finally:
            await client.close()
        raise HostError(f"shard {shard_id}: log stream ended")

    async def close(self) -> None:
        """Leave the supervisor; it keeps supervising."""
        self.client.on_push = None
        await self.client.close()


def host_stop(record: control.HostStopRecord) -> HostStop:
    return HostStop(record.host, {int(k): v for k, v in record.shards.items()}, record.error)
