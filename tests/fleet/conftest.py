"""A real OpenSSH sshd on 127.0.0.1 with its own host key, client key and known_hosts, and helpers
to write a fleet.toml that points at it and to run the `fleet` command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, host_python



def fleet_toml(tmp, *, model: str | None, data: str | None, port: int, client_key: str, known_hosts: str,
               gpus=(0, 1), extra_run: str = "", extra_host: str = "", supervise: str = "",
               address: str = "127.0.0.1", job: str = "", name: str = "box", max_restarts: int = 3) -> str:
    root = os.path.join(str(tmp), "remote")
    paths = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (("model", model), ("data", data)) if v)
    text = f"""
[run]
name = "t"
{paths}output = {json.dumps(os.path.join(root, "out"))}
layers = "speculators"
max_tokens_per_batch = 512
device = "cpu"
env = {{ OMP_NUM_THREADS = "1" }}
{extra_run}

[expected]
samples_per_s_per_gpu = 5

[supervise]
stall_timeout = "60s"
max_restarts = {max_restarts}
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
python = {json.dumps(host_python())}
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


def hosts_toml(tmp_path, servers: dict, *, model: str, data: str, gpus: dict, run: str = "t",
               output: str | None = None, extra_run: str = "", supervise: str = "") -> str:
    """One [[hosts]] per name -> sshd; each host has its own root (`root-<name>`), all share one
    output folder (a shared file system, as on a cluster) unless `output` names one per host
    ("{host}"); `supervise`: more [supervise] keys."""
    out = output or str(tmp_path / "out")
    text = f"""
[run]
name = "{run}"
model = {json.dumps(model)}
data = {json.dumps(data)}
output = {json.dumps(out)}
max_tokens_per_batch = 512
device = "cpu"
env = {{ OMP_NUM_THREADS = "1" }}
{extra_run}

[supervise]
backoff_base = "0.3s"
max_restarts = 2
connect_timeout = "3s"
{supervise}
"""
    for name, server in servers.items():
        text += f"""
[[hosts]]
name = "{name}"
address = "127.0.0.1"
port = {server.port}
user = "root"
identity_file = {json.dumps(server.client_key)}
known_hosts = {json.dumps(server.known_hosts)}
python = {json.dumps(host_python())}
gpus = {json.dumps(gpus[name])}
root = {json.dumps(str(tmp_path / ('root-' + name)))}
"""
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return str(path)
