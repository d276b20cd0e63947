"""A real OpenSSH sshd on 127.0.0.1 with its own host key, client key and known_hosts, and helpers
to write a fleet.toml that points at it and to run the `fleet` command."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading


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


def stop_supervisor(config: str) -> str:
    """The run's supervisor stopped (`fleet serve --stop`): the workers run on, unsupervised, as
    after a `fleet up` killed before supervisors outlived their clients. What it printed."""
    r = fleet("serve", "--stop", "-c", config, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def supervisor_info(config: str):
    """The run's supervisor's supervisor.json (fleet/runhome.py), or None when none runs."""
    from fleet.config import load_config
    from fleet.runhome import RunHome
    cfg = load_config(config)
    home = RunHome(cfg.run.name, cfg.path)
    return home.info() if home.held() else None


def fleet_popen(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fleet.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def hosts_toml(tmp_path, servers: dict, *, model: str | None, data: str | None, gpus: dict, run: str = "t",
               output: str | None = None, extra_run: str = "", supervise: str = "", job: str = "") -> str:
    """One [[hosts]] per name -> sshd; each host has its own root (`root-<name>`), all share one
    output folder (a shared file system, as on a cluster) unless `output` names one per host
    ("{host}"); `supervise`: more [supervise] keys; `job`: a [job] section instead of the worker."""
    out = output or str(tmp_path / "out")
    paths = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (("model", model), ("data", data)) if v)
    text = f"""
[run]
name = "{run}"
{paths}output = {json.dumps(out)}
max_tokens_per_batch = 512
device = "cpu"
env = {{ OMP_NUM_THREADS = "1" }}
{extra_run}

[supervise]
backoff_base = "0.3s"
max_restarts = 2
connect_timeout = "3s"
{supervise}

{job}
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


LOST_AFTER = 'keepalive_interval = "1s"\nkeepalive_count_max = 2\nreconnect_max = "2s"\nhost_lost_after = "3s"'


@contextlib.contextmanager
def two_hosts(tmp_path):
    """Hosts a and b, each behind a real sshd of its own: (servers, procs). After: every sshd cut
    and every shard of either host stopped."""
    from tests.sshd_server import cut, start_sshd
    servers, procs = {}, {}
    for name in ("a", "b"):
        servers[name], procs[name] = start_sshd(str(tmp_path / f"sshd-{name}"))
    try:
        yield servers, procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                cut(p)
        for name in ("a", "b"):
            run_dir = tmp_path / f"root-{name}" / "t"
            if run_dir.exists():
                subprocess.run([sys.executable, "-m", "worker.hostctl", "stop-all", "--run-dir", str(run_dir),
                                "--timeout", "2"], cwd=REPO, capture_output=True, timeout=60)


def up_headless(config: str) -> tuple[subprocess.Popen, list[str]]:
    """`fleet up --headless` running, and the lines it prints as they come."""
    up = subprocess.Popen([sys.executable, "-m", "fleet.cli", "up", "--headless", "-c", config], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(line.rstrip() for line in up.stdout), daemon=True).start()
    return up, lines


def lose_host(tmp_path, procs: dict, name: str, shards) -> None:
    """The box `name` is gone: its shards' processes killed with it, its sshd cut."""
    from tests.sshd_server import cut
    from worker.hostctl import shard_processes
    folder = tmp_path / f"root-{name}" / "t" / "shards"
    for k in shards:
        # By the environment every process of the shard inherits, never by a pid file: a pid read
        # from a file may have been reused, by then, by any process of the machine (a test worker).
        for pid in shard_processes(str(folder / str(k))):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    cut(procs[name])
