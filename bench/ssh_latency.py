"""fleet over SSH on loopback: how fast a dead worker is noticed, and how fast `status --json` is.

  detection: a real sshd on 127.0.0.1, one shard running a custom job (a sleeping Python), the
             supervisor following it; SIGKILL the process and time until the supervisor's state
             says FAILED (the bash loop this replaces polled every 15 s; Ray takes 20-55 s).
             Median and max of --trials.
  status   : `fleet status --json` against 8 hosts (8 names for the same loopback sshd, each with
             its own run folder and a live shard): wall time of the whole command (Python start
             included), and of the in-process read, median of --repeats.

    python bench/ssh_latency.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fleet.config import load_config
from fleet.state import State
from fleet.supervisor import Supervisor
from tests.sshd_server import start_sshd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_config(tmp: str, server, hosts: int, gpus: int = 1, name: str = "bench",
                 supervise: str = "max_restarts = 0") -> str:
    """fleet.toml for `hosts` names of the same loopback sshd (each its own root), `gpus` shards
    each, running a sleeping [job]."""
    parts = [f"""
[run]
name = "{name}"
output = "{tmp}/out"

[supervise]
{supervise}

[job]
command = "{{python}} -c 'import time; time.sleep(3600)'"
"""]
    for h in range(hosts):
        parts.append(f"""
[[hosts]]
name = "h{h}"
address = "127.0.0.1"
port = {server.port}
user = "root"
identity_file = "{server.client_key}"
known_hosts = "{server.known_hosts}"
python = "{sys.executable}"
gpus = {list(range(gpus))}
root = "{tmp}/root{h}"
""")
    path = os.path.join(tmp, f"fleet-{hosts}x{gpus}.toml")
    with open(path, "w") as f:
        f.write("".join(parts))
    return path


async def wait(predicate, timeout=30.0, step=0.001):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step)
    raise TimeoutError


async def detection(config_path: str, trials: int) -> dict:
    config = load_config(config_path)
    sup = Supervisor(config)
    await sup.prepare(say=lambda line: None, step=lambda line: None)
    await sup.start()
    await sup.launch_all()
    pid_file = os.path.join(config.run_dir(config.hosts[0]), "shards", "0", "pid")
    latencies = []
    for _ in range(trials):
        await wait(lambda: sup.shards[0].alive and sup.verdict(sup.shards[0]).state in (State.STARTING, State.RUNNING))
        await wait(lambda: os.path.exists(pid_file))
        pid = int(open(pid_file).read())
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        await wait(lambda: sup.verdict(sup.shards[0]).state in (State.FAILED, State.BACKOFF, State.FATAL))
        latencies.append(time.monotonic() - t0)
        await wait(lambda: not os.path.exists(pid_file))
        await sup.request([0], "restart")
    await sup.stop_all()
    await sup.close()
    return {"trials": trials, "median_s": round(statistics.median(latencies), 3),
            "max_s": round(max(latencies), 3), "min_s": round(min(latencies), 3)}


async def launch_hosts(config_path: str) -> None:
    config = load_config(config_path)
    sup = Supervisor(config)
    await sup.prepare(say=lambda line: None, step=lambda line: None)
    await sup.start()
    await sup.launch_all()
    await sup.close()


async def read_once_times(config_path: str, repeats: int) -> list[float]:
    config = load_config(config_path)
    out = []
    for _ in range(repeats):
        sup = Supervisor(config)
        t0 = time.perf_counter()
        snap = await sup.read_once()
        out.append(time.perf_counter() - t0)
        assert all(h.reachable for h in snap.hosts) and len(snap.shards) == len(config.hosts)
        await sup.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="fleet-bench-ssh-")
    server, proc = start_sshd(os.path.join(tmp, "sshd"))
    try:
        result = {"detection": asyncio.run(detection(write_config(tmp, server, 1), args.trials))}
        cfg8 = write_config(tmp, server, 8)
        asyncio.run(launch_hosts(cfg8))
        walls = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "fleet.cli", "status", "--json", "-c", cfg8],
                               cwd=REPO, capture_output=True, text=True)
            walls.append(time.perf_counter() - t0)
            assert r.returncode == 0, r.stderr
        inproc = asyncio.run(read_once_times(cfg8, args.repeats))
        result["status_8_hosts"] = {
            "repeats": args.repeats, "command_median_s": round(statistics.median(walls), 3),
            "command_max_s": round(max(walls), 3),
            "read_median_s": round(statistics.median(inproc), 3), "read_max_s": round(max(inproc), 3)}
        subprocess.run([sys.executable, "-m", "fleet.cli", "down", "--yes", "-c", cfg8], cwd=REPO,
                       capture_output=True)
    finally:
        proc.terminate()
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
