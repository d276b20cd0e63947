"""Joining a live run through its supervisor (issue 52): N hosts x 8 sleeping [job] shards through one
loopback sshd, supervised by `fleet serve`; then, interleaved, what a person runs beside it.

Every host is a name for the same real sshd on 127.0.0.1 (its own run folder). Reports, per size:

  all_running_s     from `fleet serve` until every shard is RUNNING (deploy, preflight, launch)
  join_s            `fleet up` in a real terminal (tmux, 120x40) until its view shows a RUNNING shard:
                    Python start, the join, the first picture and Textual's first frame (median)
  status_s          `fleet status --json` answered by the supervisor (whole command, median)
  status_hosts_s    the same with no supervisor: one SSH round to every host, replayed and judged
                    here (the supervisor stopped first; median)
  supervisor_cpu_pct  the supervisor's CPU over --idle seconds with no client, % of one core
  watched_cpu_pct   the same with one `fleet up --headless` client attached
  supervisor_rss_mb its peak RSS
  load              the machine's 1-minute load average then

    python bench/join.py --hosts 16 64 --json docs/results/join.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.launch_storm import proc_usage
from bench.ssh_latency import write_config
from tests.sshd_server import start_sshd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fleet(env: dict, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleet", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def timed(env: dict, *args: str) -> float:
    t0 = time.perf_counter()
    r = fleet(env, *args)
    assert r.returncode in (0, 1, 3), r.stderr[-2000:]          # (3: a host slow to answer under the storm)
    return time.perf_counter() - t0


def all_running(env: dict, cfg: str, shards: int, timeout: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        r = fleet(env, "status", "--json", "-c", cfg)
        try:
            snap = json.loads(r.stdout)
        except ValueError:
            snap = {"shards": []}
        if len(snap["shards"]) == shards and all(s["state"] == "RUNNING" for s in snap["shards"]):
            return time.monotonic() - t0
        time.sleep(2)
    raise TimeoutError("the shards never all ran")


def join_in_tmux(env: dict, cfg: str) -> float:
    """`fleet up` in a fresh tmux server at 120x40 until a RUNNING shard is on its screen; quit."""
    sock = f"fleet-join-{os.getpid()}"
    tmux = ["tmux", "-L", sock]
    envs = " ".join(f"{k}={v}" for k, v in env.items() if k == "FLEET_STATE_DIR")
    subprocess.run([*tmux, "start-server", ";", "set-option", "-g", "default-size", "120x40", ";",
                    "new-session", "-d", "-s", "j", "-x", "120", "-y", "40", "bash --norc"], check=True)
    try:
        t0 = time.perf_counter()
        subprocess.run([*tmux, "send-keys", "-t", "j", f"cd {REPO} && {envs} {sys.executable} -m fleet up -c {cfg}",
                        "Enter"], check=True)
        while time.perf_counter() - t0 < 120:
            screen = subprocess.run([*tmux, "capture-pane", "-p", "-t", "j"], capture_output=True, text=True).stdout
            if "▶ RUNNING" in screen:
                took = time.perf_counter() - t0
                break
            time.sleep(0.02)
        else:
            raise TimeoutError(f"the view never showed a running shard:\n{screen}")
        subprocess.run([*tmux, "send-keys", "-t", "j", "q"], check=True)
        time.sleep(2)
        return took
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


def cpu_over(pid: int, seconds: float) -> float:
    cpu0, _ = proc_usage(pid)
    time.sleep(seconds)
    cpu1, _ = proc_usage(pid)
    return 100.0 * (cpu1 - cpu0) / seconds


def one_size(hosts: int, gpus: int, repeats: int, idle: float, timeout: float) -> dict:
    tmp = tempfile.mkdtemp(prefix="fleet-join-")
    server, sshd = start_sshd(os.path.join(tmp, "sshd"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["FLEET_STATE_DIR"] = os.path.join(tmp, "state")
    cfg = write_config(tmp, server, hosts, gpus, name="join", supervise="max_concurrent_connects = 8")
    serve = subprocess.Popen([sys.executable, "-m", "fleet", "serve", "-c", cfg], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "serve.log"), "w"))
    out = {"hosts": hosts, "gpus_per_host": gpus, "shards": hosts * gpus}
    try:
        out["all_running_s"] = round(all_running(env, cfg, hosts * gpus, timeout), 1)
        time.sleep(15)                                       # past the launch storm
        out["supervisor_cpu_pct"] = round(cpu_over(serve.pid, idle), 1)
        watcher = subprocess.Popen([sys.executable, "-m", "fleet", "up", "--headless", "-c", cfg], cwd=REPO, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(5)
        out["watched_cpu_pct"] = round(cpu_over(serve.pid, idle), 1)
        watcher.terminate()
        watcher.wait(30)
        joins, statuses = [], []
        for _ in range(repeats):                              # interleaved: the machine's drift on both
            statuses.append(timed(env, "status", "--json", "-c", cfg))
            if shutil.which("tmux"):
                joins.append(join_in_tmux(env, cfg))
        out["status_s"] = round(statistics.median(statuses), 2)
        out["join_s"] = round(statistics.median(joins), 2) if joins else None
        out["supervisor_rss_mb"] = round(proc_usage(serve.pid)[1] / 1e6, 1)
        out["load"] = round(os.getloadavg()[0], 1)
        r = fleet(env, "serve", "--stop", "-c", cfg)
        assert r.returncode == 0, r.stderr
        serve.wait(60)
        out["status_hosts_s"] = round(statistics.median(timed(env, "status", "--json", "-c", cfg)
                                                        for _ in range(3)), 2)
    finally:
        if serve.poll() is None:
            serve.terminate()
            serve.wait(60)
        for _ in range(3):               # (a stop storm of 512 shards on 2 cores: a host may time out)
            if fleet(env, "down", "--yes", "-c", cfg).returncode == 0:
                break
        sshd.terminate()
    return out


def compiled() -> None:
    """fleet's and the worker's bytecode written, as `pip install` writes it: a checkout run with
    PYTHONDONTWRITEBYTECODE (this project's machines set it) compiles 59 modules at every start,
    0.3 s of each join."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", "fleet", "worker"], cwd=REPO, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[16, 64])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--idle", type=float, default=60.0, help="seconds the supervisor's CPU is read over")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    compiled()
    out = {"machine": f"{os.cpu_count()} cores", "command": " ".join(["python", *sys.argv]), "runs": []}
    for hosts in args.hosts:
        r = one_size(hosts, args.gpus, args.repeats, args.idle, args.timeout)
        print(json.dumps(r), flush=True)
        out["runs"].append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
