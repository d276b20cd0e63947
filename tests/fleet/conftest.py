"""A real OpenSSH sshd on 127.0.0.1 with its own host key, client key and known_hosts, and helpers
to write a fleet.toml that points at it and to run the `fleet` command."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from tests.conftest import REPO

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

    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.port} {self.host_pub}\n"


def keygen(path: str) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
    return open(path + ".pub").read().strip()


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    if not os.path.exists(SSHD):
        pytest.fail("sshd not installed: .ci/run installs openssh-server (apt-get install -y openssh-server)")
    d = str(tmp_path_factory.mktemp("sshd"))
    host_pub = " ".join(keygen(os.path.join(d, "host_key")).split()[:2])
    client_pub = keygen(os.path.join(d, "client_key"))
    with open(os.path.join(d, "authorized_keys"), "w") as f:
        f.write(client_pub + "\n")
    port = free_port()
    config = os.path.join(d, "sshd_config")
    with open(config, "w") as f:
        f.write(f"""Port {port}
ListenAddress 127.0.0.1
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
Subsystem sftp internal-sftp
LogLevel ERROR
""")
    os.makedirs("/run/sshd", exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", config], stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(d, "sshd.log"), "w"))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"sshd exited: {open(os.path.join(d, 'sshd.log')).read()}")
            time.sleep(0.1)
    known = os.path.join(d, "known_hosts")
    server = Sshd(port, os.path.join(d, "client_key"), known, host_pub, d)
    with open(known, "w") as f:
        f.write(server.known_hosts_line())
    yield server
    proc.terminate()
    proc.wait(10)


def fleet_toml(tmp, *, model: str, data: str, port: int, client_key: str, known_hosts: str,
               gpus=(0, 1), extra_run: str = "", extra_host: str = "", supervise: str = "",
               address: str = "127.0.0.1", job: str = "", name: str = "box") -> str:
    root = os.path.join(str(tmp), "remote")
    text = f"""
[run]
name = "t"
model = {json.dumps(model)}
data = {json.dumps(data)}
output = {json.dumps(os.path.join(root, "out"))}
layers = "speculators"
max_tokens_per_batch = 512
device = "cpu"
env = {{ OMP_NUM_THREADS = "1" }}
{extra_run}

[expected]
samples_per_s_per_gpu = 5

[supervise]
stall_timeout = "60s"
max_restarts = 3
backoff_base = "0.5s"
backoff_max = "2s"
connect_timeout = "5s"
{supervise}

{job}

[[hosts]]
name = "{name}"
address = "{address}"
port = {port}
user = "root"
identity_file = {json.dumps(client_key)}
known_hosts = {json.dumps(known_hosts)}
python = {json.dumps(sys.executable)}
gpus = {json.dumps(list(gpus))}
root = {json.dumps(os.path.join(root, "fleet"))}
{extra_host}
"""
    path = os.path.join(str(tmp), "fleet.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def fleet(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, **kw)


def fleet_popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fleet.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
