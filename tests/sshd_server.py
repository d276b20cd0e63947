"""A real OpenSSH sshd on 127.0.0.1 with its own host key, client key and known_hosts.

Used by the test fixture and by the benchmarks that measure fleet over SSH."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Sshd:
    port: int
    client_key: str
    known_hosts: str
    host_pub: str
    dir: str

    address: str = "127.0.0.1"

    def known_hosts_line(self) -> str:
        return f"[{self.address}]:{self.port} {self.host_pub}\n"


def keygen(path: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
    return open(path + ".pub").read().strip()


class SshdError(Exception):
    pass


def start_sshd(d: str, address: str = "127.0.0.1", prefix: tuple[str, ...] = (),
               sftp: bool = True, extra: str = "") -> tuple[Sshd, subprocess.Popen]:
    """Start sshd -D in folder `d` (keys, config, known_hosts all made there), listening on
    `address`; `prefix` runs it through another command (e.g. `ip netns exec NS`); `sftp=False`
    leaves out the SFTP subsystem, as some locked-down hosts do; `extra`: more sshd_config lines
    (e.g. `SetEnv SLURM_CONF=...` for a Slurm login node)."""
    os.makedirs(d, exist_ok=True)
    if not os.path.exists(SSHD):
        raise SshdError("sshd not installed: scripts/test.sh installs openssh-server")
    host_pub = " ".join(keygen(os.path.join(d, "host_key")).split()[:2])
    client_pub = keygen(os.path.join(d, "client_key"))
    with open(os.path.join(d, "authorized_keys"), "w") as f:
        f.write(client_pub + "\n")
    port = free_port()
    config = os.path.join(d, "sshd_config")
    with open(config, "w") as f:
        f.write(f"""Port {port}
ListenAddress {address}
HostKey {d}/host_key
PidFile {d}/sshd.pid
AuthorizedKeysFile {d}/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin yes
StrictModes no
UsePAM no
MaxStartups 100
MaxSessions 100
AllowTcpForwarding yes
{'Subsystem sftp internal-sftp' if sftp else ''}
LogLevel ERROR
{extra}
""")
    known = os.path.join(d, "known_hosts")
    server = Sshd(port, os.path.join(d, "client_key"), known, host_pub, d, address)
    with open(known, "w") as f:
        f.write(server.known_hosts_line())
    return server, serve(server, prefix)


def serve(server: Sshd, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """Run the sshd made in `server.dir` (again, after `cut`: same port, same keys) until it listens."""
    os.makedirs("/run/sshd", exist_ok=True)
    d = server.dir
    proc = subprocess.Popen([*prefix, SSHD, "-D", "-e", "-f", os.path.join(d, "sshd_config")],
                            stdout=subprocess.DEVNULL, stderr=open(os.path.join(d, "sshd.log"), "w"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection((server.address, server.port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                raise SshdError(f"sshd exited: {open(os.path.join(d, 'sshd.log')).read()}")
            time.sleep(0.1)
    return proc


def cut(proc: subprocess.Popen) -> None:
    """The host falls off the network: sshd and every connection it serves killed at once."""
    def children(pid: int) -> list[int]:
        out = []
        for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            try:
                out += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
            except OSError:
                pass
        return out
    tree, todo = [], [proc.pid]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children(pid)
    for pid in tree:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
    proc.wait(10)


