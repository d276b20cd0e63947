"""How the supervisor reaches a host: local subprocesses, or one asyncssh connection per host.

Both take commands as argv lists. Over SSH each argument is `shlex.quote`d (via shlex.join), so
nothing from fleet.toml ever reaches a remote shell as code. Host keys are checked against
known_hosts; an unknown host is trusted only with `accept_new = true`, a changed key never.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from dataclasses import dataclass
from typing import AsyncIterator

from .config import HostSpec, SuperviseSpec


class HostError(Exception):
    """The host cannot be reached or used; the message is one line and names the host."""


class HostUnusable(HostError):
    """The host answers but cannot run the worker (its python is missing or broken, its root is
    not writable, a worker module failed): a preflight refusal, not an unreachable host."""


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


class Transport:
    def __init__(self, host: HostSpec):
        self.host = host

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
                await asyncio.wait_for(self.proc.wait(), 5)
            except asyncio.TimeoutError:
                self.proc.kill()


class LocalTransport(Transport):
    async def run(self, argv: list[str], timeout: float | None = 120, input: bytes | None = None) -> Completed:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL if input is None else asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            raise HostError(f"{self.host.name}: cannot run {argv[0]}: {e.strerror}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(input), timeout)
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


class SSHTransport(Transport):
    """One connection per host; connects are bounded fleet-wide by a semaphore (sshd MaxStartups)."""

    def __init__(self, host: HostSpec, supervise: SuperviseSpec, connect_slots: asyncio.Semaphore):
        super().__init__(host)
        self.supervise = supervise
        self.slots = connect_slots
        self.conn = None

    @property
    def connected(self) -> bool:
        return self.conn is not None and not self.conn.is_closed()

    @property
    def where(self) -> str:
        h = self.host
        return f"{h.name} ({h.user + '@' if h.user else ''}{h.address}:{h.port})"

    async def connect(self) -> None:
        import asyncssh

        if self.connected:
            return
        h = self.host
        known_hosts = os.path.expanduser(h.known_hosts)
        kwargs = dict(port=h.port, connect_timeout=self.supervise.connect_timeout,
                      keepalive_interval=self.supervise.keepalive_interval,
                      keepalive_count_max=self.supervise.keepalive_count_max)
        if h.user:
            kwargs["username"] = h.user                   # else asyncssh's default: the local user
        if h.identity_file:
            key = os.path.expanduser(h.identity_file)
            if not os.path.exists(key):
                raise HostError(f"{self.where}: identity_file {h.identity_file} not found")
            kwargs["client_keys"] = [key]
        async with self.slots:
            try:
                self.conn = await self._open(known_hosts, kwargs)
            except asyncssh.KeyImportError as e:
                raise HostError(f"{self.where}: identity_file {h.identity_file} cannot be used: {e} "
                                f"(an encrypted key: add it to the SSH agent with ssh-add and leave "
                                f"identity_file out)") from None
            except asyncssh.PermissionDenied:
                raise HostError(f"{self.where}: authentication failed (key "
                                f"{h.identity_file or 'from the SSH agent / ~/.ssh'})") from None
            except (asyncio.TimeoutError, TimeoutError):
                raise HostError(f"{self.where}: connection timed out after "
                                f"{self.supervise.connect_timeout:.0f}s") from None
            except ConnectionRefusedError:
                raise HostError(f"{self.where}: connection refused (is sshd listening on port "
                                f"{h.port}?)") from None
            except asyncssh.Error as e:
                raise HostError(f"{self.where}: SSH error: {e.reason}") from None
            except OSError as e:
                raise HostError(f"{self.where}: {e.strerror or e}") from None

    async def _open(self, known_hosts: str, kwargs: dict):
        """Connect, checking the host key against known_hosts. A key never seen is trusted only
        with accept_new; otherwise the host is reached once for its key alone (no login), so a
        dead host reads as unreachable and a live one names the key to trust."""
        import asyncssh
        h = self.host
        if os.path.exists(known_hosts):
            try:
                return await asyncssh.connect(h.address, known_hosts=known_hosts, **kwargs)
            except asyncssh.HostKeyNotVerifiable:
                if self._key_is_known(known_hosts):
                    raise HostError(
                        f"{self.where}: host key does not match {h.known_hosts} — it CHANGED; if "
                        f"that is expected, remove the old entry (ssh-keygen -R '[{h.address}]:{h.port}' "
                        f"-f {h.known_hosts}) and connect again") from None
        if h.accept_new:
            return await self._connect_accept_new(known_hosts, kwargs)
        key = await asyncio.wait_for(asyncssh.get_server_host_key(h.address, h.port),
                                     self.supervise.connect_timeout)
        offered = f"{key.get_algorithm()} {key.get_fingerprint()}" if key is not None else "none offered"
        raise HostError(
            f"{self.where}: host key unknown (not in {h.known_hosts}; it offers {offered}); to "
            f"trust it run ssh-keyscan -p {h.port} {h.address} >> {h.known_hosts}, or set "
            f"accept_new = true for this host")

    def _key_is_known(self, known_hosts: str) -> bool:
        import asyncssh
        if not os.path.exists(known_hosts):
            return False
        try:
            trusted = asyncssh.read_known_hosts(known_hosts).match(self.host.address, "", self.host.port)
        except Exception:
            return False
        return bool(trusted[0] or trusted[1])

    async def _connect_accept_new(self, known_hosts: str, kwargs: dict):
        """ssh's accept-new: trust and record a host never seen before (never a changed one)."""
        import asyncssh
        conn = await asyncssh.connect(self.host.address, known_hosts=None, **kwargs)
        key = conn.get_server_host_key()
        entry = self.host.address if self.host.port == 22 else f"[{self.host.address}]:{self.host.port}"
        os.makedirs(os.path.dirname(known_hosts) or ".", exist_ok=True)
        with open(known_hosts, "a") as f:
            f.write(f"{entry} {key.export_public_key('openssh').decode().strip()}\n")
        return conn

    async def _ensure(self):
        if not self.connected:
            await self.connect()
        return self.conn

    async def run(self, argv: list[str], timeout: float | None = 120, input: bytes | None = None) -> Completed:
        import asyncssh
        conn = await self._ensure()
        try:
            r = await asyncio.wait_for(conn.run(shlex.join(argv), check=False, input=input, encoding=None),
                                       timeout)
        except asyncio.TimeoutError:
            raise HostError(f"{self.where}: {argv[0]} timed out after {timeout:.0f}s") from None
        except (asyncssh.Error, OSError) as e:
            self.conn = None
            raise HostError(f"{self.where}: connection lost: {getattr(e, 'reason', e)}") from None
        rc = r.exit_status if r.exit_status is not None else 255
        return Completed(rc, (r.stdout or b"").decode("utf-8", "replace"),
                         (r.stderr or b"").decode("utf-8", "replace"))

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
                await asyncio.wait_for(self.conn.wait_closed(), 5)
            except Exception:
                pass
            self.conn = None


def make_transport(host: HostSpec, supervise: SuperviseSpec, slots: asyncio.Semaphore) -> Transport:
    return LocalTransport(host) if host.is_local else SSHTransport(host, supervise, slots)
