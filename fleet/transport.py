"""How the supervisor reaches a host: local subprocesses, or one asyncssh connection per host.

Both take commands as argv lists. Over SSH each argument is `shlex.quote`d (via shlex.join), so
nothing from fleet.toml ever reaches a remote shell as code. Host keys are checked against
known_hosts; an unknown host is trusted only with `accept_new = true`, a changed key never.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shlex
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator

from worker.text import printable

from .config import HostSpec, SuperviseSpec

if TYPE_CHECKING:
    from asyncssh import SSHClientConnection

# asyncssh's import warns that the `cryptography` it uses deprecates DSA, on every fleet command's
# stderr; fleet never offers DSA keys of its own, and a person's one-line error must stay last.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh(\..*)?")


class HostError(Exception):
    """The host cannot be reached or used; the message is one line and names the host."""


class HostUnusable(HostError):
    """The host answers but cannot run the worker (its python is missing or broken, its root is
    not writable, a worker module failed): a preflight refusal, not an unreachable host."""


class RunClaimed(HostError):
    """The host's agent says another supervisor holds the run (worker/claim.py): `holder` is who."""

    def __init__(self, message: str, holder):
        super().__init__(message)
        self.holder = holder


@dataclass
class Completed:
    rc: int
    stdout: str
    stderr: str


class Stream:
    """A long-lived remote process whose stdout we read line by line; closing it ends the process."""

    async def lines(self) -> AsyncIterator[str]:
        raise NotImplementedError
        yield ""                                                           # pragma: no cover

    async def close(self) -> None:
        raise NotImplementedError

    def ping(self) -> None:
        """A line on the process's stdin: a claiming agent (worker/claim.py) hears its supervisor."""


class Transport:
    """Commands on one host, argv only. An async context manager: connected inside, closed after."""

    def __init__(self, host: HostSpec):
        self.host = host
        self.worker_at: str | None = None    # this fleet's worker is known to be there (deploy sets it)

    async def __aenter__(self) -> Transport:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self) -> None:
        pass

    async def run(self, argv: list[str], timeout: float | None = 120, input: bytes | None = None) -> Completed:
        """Run to completion; output decoded as UTF-8 with undecodable bytes replaced."""
        raise NotImplementedError

    async def stream(self, argv: list[str]) -> Stream:
        """A long-lived process; its stderr is merged into the lines read (its last words)."""
        raise NotImplementedError

    async def close(self) -> None:
        pass

    @property
    def connected(self) -> bool:
        return True


# --- local -------------------------------------------------------------------------------------

class LocalStream(Stream):
    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    async def lines(self) -> AsyncIterator[str]:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            yield raw.decode("utf-8", "replace")

    async def close(self) -> None:
        if self.proc.returncode is None:
            if self.proc.stdin:
                self.proc.stdin.close()
            try:
                self.proc.terminate()
            except ProcessLookupError:
                pass
            try:
                async with asyncio.timeout(5):
                    await self.proc.wait()
            except asyncio.TimeoutError:
                self.proc.kill()

    def ping(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.write(b"\n")


class LocalTransport(Transport):
    async def run(self, argv: list[str], timeout: float | None = 120, input: bytes | None = None) -> Completed:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL if input is None else asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            raise HostError(f"{self.host.name}: cannot run {argv[0]}: {e.strerror}") from None
        try:
            async with asyncio.timeout(timeout):
                out, err = await proc.communicate(input)
        except asyncio.TimeoutError:
            proc.kill()
            raise HostError(f"{self.host.name}: {argv[0]} timed out after {timeout:.0f}s") from None
        return Completed(proc.returncode or 0, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

    async def stream(self, argv: list[str]) -> Stream:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT, limit=1 << 24)
        except OSError as e:
            raise HostError(f"{self.host.name}: cannot run {argv[0]}: {e.strerror}") from None
        return LocalStream(proc)


# --- SSH ---------------------------------------------------------------------------------------

class SSHStream(Stream):
    def __init__(self, proc):
        self.proc = proc

    async def lines(self) -> AsyncIterator[str]:
        async for raw in self.proc.stdout:
            yield raw.decode("utf-8", "replace")

    async def close(self) -> None:
        try:
            self.proc.stdin.write_eof()
        except Exception:
            pass
        self.proc.close()

    def ping(self) -> None:
        try:
            self.proc.stdin.write(b"\n")
        except Exception:                    # a channel closing: its reader says so
            pass


SSH_CONFIG = "~/.ssh/config"
DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


def _tilde(path: str) -> str:
    """A path as the user wrote it: $HOME shown as ~."""
    home = os.path.expanduser("~")
    return "~" + path[len(home):] if home != "~" and (path + "/").startswith(home + "/") else path


# AES-GCM first (asyncssh's default puts chacha20-poly1305 first): the supervisor decrypts every
# telemetry line of every host, and AES-GCM costs ~2 us a packet against chacha20's ~13 us in
# asyncssh (AES-NI; bench/join.py: a tenth of the supervisor's CPU at 64 hosts). Every OpenSSH since
# 6.2 offers it; the others stay listed for servers that do not. A `Ciphers` line in the user's
# OpenSSH config wins.
CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com", "chacha20-poly1305@openssh.com",
           "aes128-ctr", "aes192-ctr", "aes256-ctr")


@functools.lru_cache(maxsize=1)
def _traced_config():
    """asyncssh's own OpenSSH config parser, also noting the file and line each option came from:
    fleet reads the file exactly as asyncssh will when it connects, and can say where a setting that
    failed was written."""
    from asyncssh.config import SSHClientConfig

    def traced(handler):
        def record(self, option, args):
            new = option not in self._options
            handler(self, option, args)
            if new and option in self._options:
                self.origin.setdefault(option, f"{_tilde(str(self._path))} line {self._line_no}")
        return record

    class Traced(SSHClientConfig):
        def __init__(self, *args):
            super().__init__(*args)
            self.origin: dict[str, str] = {}

        _handlers = {key: (option, handler if option in ("Host", "Match", "Include") else traced(handler))
                     for key, (option, handler) in SSHClientConfig._handlers.items()}
    return Traced


@dataclass
class Resolved:
    """Where a host entry really leads, the way `ssh ADDRESS` would take it: fleet.toml's keys, else
    the OpenSSH config's settings for the address (an alias), else ssh's defaults. `origin` names
    where a setting came from ("fleet.toml", "~/.ssh/config line 4"); a default has none."""
    alias: str
    host: str
    port: int
    user: str
    known_hosts: str                     # as written (for messages); expanded with os.path.expanduser
    identity_files: list[str]
    jump: str | None                     # ProxyJump: comma-separated [user@]alias[:port] hops
    config: list[str]                    # the config file given to asyncssh ([] when there is none)
    origin: dict[str, str]
    ciphers: bool = False                # the config file chooses the ciphers (Ciphers): fleet does not

    @property
    def target(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"

    @property
    def where(self) -> str:
        return self.target if self.alias == self.host else f"{self.alias} = {self.target}"

    def from_file(self, key: str) -> bool:
        return self.origin.get(key, "fleet.toml") != "fleet.toml"

    def said(self, key: str, value) -> str:
        """'port 2222 from ~/.ssh/config line 4' when the config file set it, else 'port 2222'."""
        return f"{key} {value}" + (f" from {self.origin[key]}" if self.from_file(key) else "")

    def config_name(self) -> str:
        return _tilde(self.config[0]) if self.config else f"{SSH_CONFIG} (there is none)"


def resolve(name: str, address: str, ssh_config: str | None = None, *, port: int | None = None,
            user: str | None = None, identity_file: str | None = None,
            known_hosts: str | None = None) -> Resolved:
    """Resolve `address` through the OpenSSH config: `ssh_config`, else ~/.ssh/config when it exists.
    `~` is $HOME (os.path.expanduser, as asyncssh expands it), so fleet and asyncssh read the same
    file; OpenSSH's own ssh takes the home from the password database, the same unless HOME is moved."""
    import getpass
    path = os.path.expanduser(ssh_config or SSH_CONFIG)
    paths = [path] if ssh_config or os.path.isfile(path) else []
    try:
        local_user = getpass.getuser()
    except (KeyError, OSError):
        raise HostError(f"{name}: no user given and no local user name to default to (set USER)") from None
    try:
        cfg = _traced_config().load(None, paths, False, False, False, local_user,
                                    user if user else (), address, port if port else ())
    except OSError as e:
        raise HostError(f"{name}: cannot read {_tilde(path)}: {e.strerror}") from None
    except ValueError as e:                                   # asyncssh's ConfigParseError: file line N
        raise HostError(f"{name}: {_tilde(path)}: {e}") from None
    origin = {"hostname": cfg.origin.get("Hostname"), "port": cfg.origin.get("Port"),
              "user": cfg.origin.get("User"), "known_hosts": cfg.origin.get("UserKnownHostsFile"),
              "identity_file": cfg.origin.get("IdentityFile"), "ProxyJump": cfg.origin.get("ProxyJump")}
    for key, value in (("port", port), ("user", user), ("identity_file", identity_file),
                       ("known_hosts", known_hosts)):
        if value:
            origin[key] = "fleet.toml"
    files = cfg.get("UserKnownHostsFile") or [DEFAULT_KNOWN_HOSTS]
    keys = [identity_file] if identity_file else list(cfg.get("IdentityFile") or [])
    return Resolved(alias=address, host=str(cfg.get("Hostname") or address), port=int(cfg.get("Port", 22)),
                    user=str(cfg.get("User") or local_user), known_hosts=known_hosts or files[0],
                    identity_files=keys, jump=cfg.get("ProxyJump"), config=paths,
                    origin={k: v for k, v in origin.items() if v}, ciphers=cfg.get("Ciphers") is not None)


class SSHTransport(Transport):
    """One connection per host; connects are bounded fleet-wide by a semaphore (sshd MaxStartups).
    The host's address is resolved through the OpenSSH config on every connect (see `resolve`)."""

    def __init__(self, host: HostSpec, supervise: SuperviseSpec, connect_slots: asyncio.Semaphore):
        super().__init__(host)
        self.supervise = supervise
        self.slots = connect_slots
        self.conn: SSHClientConnection | None = None
        self.resolved: Resolved | None = None

    @property
    def connected(self) -> bool:
        return self.conn is not None and not self.conn.is_closed()

    @property
    def where(self) -> str:
        h = self.host
        if self.resolved is None:
            return f"{h.name} ({h.user + '@' if h.user else ''}{h.address}{':' + str(h.port) if h.port else ''})"
        return f"{h.name} ({self.resolved.where})"

    async def connect(self) -> None:
        import asyncssh

        if self.connected:
            return
        h = self.host
        self.conn = None
        self.worker_at = None                # a new connection: the host may have been wiped since
        r = self.resolved = resolve(h.name, h.address, h.ssh_config, port=h.port, user=h.user,
                                    identity_file=h.identity_file, known_hosts=h.known_hosts)
        known_hosts = os.path.expanduser(r.known_hosts)
        kwargs = dict(config=r.config, connect_timeout=self.supervise.connect_timeout,
                      keepalive_interval=self.supervise.keepalive_interval,
                      keepalive_count_max=self.supervise.keepalive_count_max)
        if h.port:
            kwargs["port"] = h.port
        if h.user:
            kwargs["username"] = h.user
        if not r.ciphers:
            kwargs["encryption_algs"] = CIPHERS
        if h.identity_file:
            key = os.path.expanduser(h.identity_file)
            if not os.path.exists(key):
                raise HostError(f"{self.where}: identity_file {h.identity_file} not found")
            kwargs["client_keys"] = [key]
        async with self.slots:
            jump = None
            try:
                if r.jump:
                    jump = kwargs["tunnel"] = await self._open_jumps(r)
                conn = self.conn = await self._open(known_hosts, kwargs)
                if jump is not None:
                    conn.set_tunnel(jump)          # closing the connection closes its hops
            except asyncssh.KeyImportError as e:
                raise HostError(f"{self.where}: identity_file {h.identity_file} cannot be used: {e} "
                                f"(an encrypted key: add it to the SSH agent with ssh-add and leave "
                                f"identity_file out)") from None
            except (asyncssh.Error, OSError, asyncio.TimeoutError, TimeoutError) as e:
                raise HostError(f"{self.where}: {self._why(e, r)}") from None
            except UnicodeError as e:             # the resolver's IDNA codec refused the name
                why = str(e).rpartition(": ")[2].rstrip(")")          # "label empty or too long"
                raise HostError(f"{self.where}: the address {printable(r.host)!r} is not a host "
                                f"name the resolver takes ({why})") from None
            finally:
                if self.conn is None and jump is not None:
                    jump.close()

    def _why(self, e: Exception, r: Resolved) -> str:
        """One line on why connecting to `r` failed, naming the setting (and its file) at fault."""
        import asyncssh
        import socket
        if isinstance(e, asyncssh.PermissionDenied):
            keys = r.said("identity_file", r.identity_files[0]) if r.identity_files else \
                "keys from the SSH agent / ~/.ssh"
            return f"authentication failed as {r.said('user', r.user)} ({keys})"
        if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
            return f"connection timed out after {self.supervise.connect_timeout:.0f}s"
        if isinstance(e, ConnectionRefusedError):
            return (f"{r.said('port', r.port) + ': ' if r.from_file('port') else ''}connection refused "
                    f"(is sshd listening on port {r.port}?)")
        if isinstance(e, socket.gaierror):
            if r.from_file("hostname"):
                return f"{r.said('hostname', r.host)} does not resolve: {e.strerror}"
            return (f"{r.alias!r} does not resolve: no such host ({e.strerror}), and "
                    f"{r.config_name()} gives it no HostName")
        if isinstance(e, asyncssh.ChannelOpenError):          # the last jump host could not reach it
            port = f" ({r.said('port', r.port)})" if r.from_file("port") else ""
            return f"the jump host cannot reach {r.host}:{r.port}{port}: {e.reason}"
        if isinstance(e, asyncssh.HostKeyNotVerifiable):      # a jump host (the target's is _open's)
            return (f"host key not trusted by {r.said('known_hosts', r.known_hosts)}; to trust it run "
                    f"ssh-keyscan -p {r.port} {r.host} >> {r.known_hosts}")
        if isinstance(e, (asyncssh.ConnectionLost, ConnectionResetError)):
            # TCP connected, then closed (or reset, when the close beats our first bytes) before SSH spoke
            return (f"{r.host}:{r.port} closed the connection before SSH began (not sshd on that port, a "
                    f"firewall or proxy in the way, or sshd refusing under load: MaxStartups)")
        if isinstance(e, asyncssh.Error):
            return f"SSH error: {e.reason}"
        assert isinstance(e, OSError), "connect() catches asyncssh.Error, OSError and timeouts alone"
        return str(e.strerror or e)                           # another OSError

    async def _open_jumps(self, r: Resolved) -> SSHClientConnection:
        """Open the ProxyJump hops in turn, each through the one before (as asyncssh and ssh do);
        each hop is resolved through the same config file. Returns the last hop's connection."""
        import asyncssh
        assert r.jump, "connect() opens jumps only where ProxyJump is set"
        conn: SSHClientConnection | None = None
        for hop in r.jump.split(","):
            user, _, rest = hop.rpartition("@")
            alias, _, port = rest.partition(":")
            hr = resolve(self.host.name, alias, r.config[0] if r.config else None,
                         port=int(port) if port.isdigit() else None, user=user or None)
            known = os.path.expanduser(hr.known_hosts)
            try:
                if not os.path.exists(known):
                    raise asyncssh.HostKeyNotVerifiable("no known_hosts file")
                nxt = await asyncssh.connect(alias, int(port) if port.isdigit() else (), tunnel=conn or (),
                                             username=user or (), config=r.config, known_hosts=known,
                                             connect_timeout=self.supervise.connect_timeout)
            except (asyncssh.Error, OSError, asyncio.TimeoutError, TimeoutError) as e:
                if conn is not None:
                    conn.close()
                via = r.said("ProxyJump", r.jump)
                raise HostError(f"{self.where}: jump host {hr.where} ({via}): "
                                f"{self._why(e, hr)}") from None
            if conn is not None:
                nxt.set_tunnel(conn)
            conn = nxt
        assert conn is not None, "a non-empty ProxyJump has a hop"
        return conn

    async def _open(self, known_hosts: str, kwargs: dict) -> SSHClientConnection:
        """Connect, checking the host key against known_hosts. A key never seen is trusted only
        with accept_new; otherwise the host is reached once for its key alone (no login), so a
        dead host reads as unreachable and a live one names the key to trust."""
        import asyncssh
        h, r = self.host, self.resolved
        assert r is not None, "connect() resolves the host before it opens"
        if os.path.exists(known_hosts):
            try:
                return await asyncssh.connect(h.address, known_hosts=known_hosts, **kwargs)
            except asyncssh.HostKeyNotVerifiable:
                if self._key_is_known(known_hosts):
                    raise HostError(
                        f"{self.where}: host key does not match {r.said('known_hosts', r.known_hosts)} "
                        f"— it CHANGED; if that is expected, remove the old entry (ssh-keygen -R "
                        f"'[{r.host}]:{r.port}' -f {r.known_hosts}) and connect again") from None
        if h.accept_new:
            return await self._connect_accept_new(known_hosts, kwargs)
        if os.path.realpath(known_hosts) == os.devnull:       # SkyPilot's entries: trust any key
            raise HostError(
                f"{self.where}: host key unknown: {r.said('known_hosts', r.known_hosts)} keeps no keys; "
                f"set known_hosts = \"~/.ssh/known_hosts\" and accept_new = true for this host (its key "
                f"is recorded on the first connect and checked after)")
        probe = {k: kwargs[k] for k in ("port", "tunnel", "config") if k in kwargs}
        async with asyncio.timeout(self.supervise.connect_timeout):
            key = await asyncssh.get_server_host_key(h.address, **probe)
        offered = f"{key.get_algorithm()} {key.get_fingerprint()}" if key is not None else "none offered"
        raise HostError(
            f"{self.where}: host key unknown (not in {r.said('known_hosts', r.known_hosts)}; it offers "
            f"{offered}); to "
            f"trust it run ssh-keyscan -p {r.port} {r.host} >> {r.known_hosts}, or set "
            f"accept_new = true for this host")

    def _key_is_known(self, known_hosts: str) -> bool:
        import asyncssh
        if not os.path.exists(known_hosts):
            return False
        r = self.resolved
        assert r is not None, "connect() resolves the host before it opens"
        try:
            trusted = asyncssh.read_known_hosts(known_hosts).match(r.host, "", r.port)
        except Exception:
            return False
        return bool(trusted[0] or trusted[1])

    async def _connect_accept_new(self, known_hosts: str, kwargs: dict) -> SSHClientConnection:
        """ssh's accept-new: trust and record a host never seen before (never a changed one)."""
        import asyncssh
        conn = await asyncssh.connect(self.host.address, known_hosts=None, **kwargs)
        key = conn.get_server_host_key()
        assert key is not None, "an SSH connection has received its server's host key"
        r = self.resolved
        assert r is not None, "connect() resolves the host before it opens"
        entry = r.host if r.port == 22 else f"[{r.host}]:{r.port}"
        os.makedirs(os.path.dirname(known_hosts) or ".", exist_ok=True)
        with open(known_hosts, "a") as f:
            f.write(f"{entry} {key.export_public_key('openssh').decode().strip()}\n")
        return conn

    async def _ensure(self) -> SSHClientConnection:
        if not self.connected:
            await self.connect()
        assert self.conn is not None, "connect() connects or raises HostError"
        return self.conn

    async def run(self, argv: list[str], timeout: float | None = 120, input: bytes | None = None) -> Completed:
        import asyncssh
        conn = await self._ensure()
        try:
            async with asyncio.timeout(timeout):
                r = await conn.run(shlex.join(argv), check=False, input=input, encoding=None)
        except asyncio.TimeoutError:
            raise HostError(f"{self.where}: {argv[0]} timed out after {timeout:.0f}s") from None
        except (asyncssh.Error, OSError) as e:
            self.conn = None
            raise HostError(f"{self.where}: connection lost: {getattr(e, 'reason', e)}") from None
        rc = r.exit_status if r.exit_status is not None else 255
        return Completed(rc, _decoded(r.stdout), _decoded(r.stderr))

    async def stream(self, argv: list[str]) -> Stream:
        import asyncssh
        conn = await self._ensure()
        try:
            proc = await conn.create_process(shlex.join(argv), stderr=asyncssh.STDOUT, encoding=None)
        except (asyncssh.Error, OSError) as e:
            self.conn = None
            raise HostError(f"{self.where}: connection lost: {getattr(e, 'reason', e)}") from None
        return SSHStream(proc)

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            try:
                async with asyncio.timeout(5):
                    await self.conn.wait_closed()
            except Exception:
                pass
            self.conn = None


def _decoded(out: bytes | str | None) -> str:
    """A remote command's output: bytes with encoding=None (asyncssh types it bytes or str either way)."""
    return out.decode("utf-8", "replace") if isinstance(out, bytes) else out or ""


def make_transport(host: HostSpec, supervise: SuperviseSpec, slots: asyncio.Semaphore) -> Transport:
    return LocalTransport(host) if host.is_local else SSHTransport(host, supervise, slots)
