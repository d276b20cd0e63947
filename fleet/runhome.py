"""Where a run's supervisor lives on this machine: one folder per fleet.toml, holding its control
socket, its log, the lock that makes it the only one, and `supervisor.json` (who it is, where it
is reached). Every path a client or the supervisor uses is made here, once.

    $FLEET_STATE_DIR, else $XDG_STATE_HOME/fleet, else ~/.local/state/fleet
        <run>-<hash of fleet.toml's absolute path>/      (mode 700: only its user enters)
            supervisor.sock     the control socket (mode 600)
            supervisor.lock     flock'd by the supervisor for its whole life
            supervisor.json     SupervisorInfo, written once it listens
            supervisor.log      what it did (deploys, actions, moves, errors)

The folder is keyed by the config file's path, not the run's name: two copies of a fleet.toml are
two folders here, and the run's hosts (the agents' claim, worker/agent.py) refuse the second
supervisor. A socket path longer than a Unix socket takes (about 100 bytes) goes under /tmp.
"""

from __future__ import annotations

import fcntl
import getpass
import hashlib
import json
import os
import re
import socket
import sys
import time
from dataclasses import asdict, dataclass, field

SOCKET_MAX = 100              # sun_path holds 108 bytes on Linux, 104 on macOS


def state_root() -> str:
    explicit = os.environ.get("FLEET_STATE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(xdg, "fleet")


def config_key(config_path: str) -> str:
    return hashlib.sha256(os.path.abspath(config_path).encode()).hexdigest()[:12]


def config_digest(path: str) -> str:
    """Of a fleet.toml's bytes: a client compares it with its supervisor's to know whether that
    one supervises by the file the client would."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def user_name() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


@dataclass
class SupervisorInfo:
    """Who supervises the run and how to reach it: written by the supervisor once it listens,
    read by clients (and shown by `fleet status`)."""
    run: str
    pid: int
    machine: str
    user: str
    started: float
    config: str                    # the absolute path of the fleet.toml it supervises by
    config_digest: str             # of that file's bytes when it started
    bundle: str                    # the worker bundle's hash it deploys
    socket: str
    log: str
    python: str = sys.executable
    metrics: str | None = None

    @property
    def id(self) -> str:
        """Names this supervisor among every other (a host's claim is by it)."""
        return f"{self.machine}:{self.pid}:{self.started:.3f}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_dict(cls, d: dict) -> SupervisorInfo:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})

    def where(self) -> str:
        """'pid 4242 on gpu-head (as me) since 12:01:07'."""
        since = time.strftime("%H:%M:%S", time.localtime(self.started))
        here = "here" if self.machine == socket.gethostname() else f"on {self.machine}"
        return f"pid {self.pid} {here} (as {self.user}) since {since}"


@dataclass
class RunHome:
    """The folder of one fleet.toml's supervisor on this machine."""
    run: str
    config_path: str
    root: str = field(default_factory=state_root)

    @property
    def dir(self) -> str:
        name = re.sub(r"[^A-Za-z0-9._-]", "_", self.run)[:40] or "run"
        return os.path.join(self.root, f"{name}-{config_key(self.config_path)}")

    @property
    def socket(self) -> str:
        path = os.path.join(self.dir, "supervisor.sock")
        if len(path.encode()) <= SOCKET_MAX:
            return path
        return os.path.join(f"/tmp/fleet-{os.getuid()}", f"{config_key(self.config_path)}.sock")

    @property
    def lock(self) -> str:
        return os.path.join(self.dir, "supervisor.lock")

    @property
    def info_path(self) -> str:
        return os.path.join(self.dir, "supervisor.json")

    @property
    def log(self) -> str:
        return os.path.join(self.dir, "supervisor.log")

    def make(self) -> None:
        """The folder (and the socket's, where that is elsewhere), owner-only."""
        for folder in {self.dir, os.path.dirname(self.socket)}:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            os.chmod(folder, 0o700)

    def info(self) -> SupervisorInfo | None:
        """The supervisor that wrote supervisor.json, if that file is there and whole."""
        try:
            with open(self.info_path) as f:
                return SupervisorInfo.from_dict(json.load(f))
        except (OSError, ValueError, TypeError):
            return None

    def write_info(self, info: SupervisorInfo) -> None:
        tmp = f"{self.info_path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(info.to_json())
        os.replace(tmp, self.info_path)

    def hold(self) -> int | None:
        """Take the supervisor's lock for this process's life: its fd, or None when another holds it."""
        self.make()
        fd = os.open(self.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        os.set_inheritable(fd, False)
        return fd

    def held(self) -> bool:
        """Whether a live supervisor holds the lock now."""
        return lock_held(self.lock)


def lock_held(path: str) -> bool:
    """Whether a live process holds the flock on `path` (a supervisor's lock) now."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
