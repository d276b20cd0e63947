"""A launch storm over SSH on loopback: N hosts x 8 GPUs of a sleeping [job], all launched at once,
then the supervisor stopped, and the commands a person runs beside it.

Every host is a name for the same real sshd on 127.0.0.1 (its own run folder), so the whole fleet's
launches, runners and sleeping jobs share this machine's cores, as the issue's 2-core probe did.
Reports, per fleet size:

  all_running_s     from `launch_all` until every shard is RUNNING in the supervisor's view
  false_failures    shards counted failed (a failure, a failed launch) although the host's record
                    shows them started: must be 0
  unreachable       hosts marked unreachable during the storm (no telemetry for the silence limit)
  supervisor_cpu_s  the supervisor process's CPU time from launch to all RUNNING + 10 s
  stopped           `fleet up --headless` re-attached, SIGSTOPped for --stop seconds, continued and
                    watched for 30 s more: the false verdicts it printed (STALLED, FAILED, BACKOFF,
                    UNKNOWN, FATAL, unreachable, an automatic action: must be 0), its CPU seconds
                    and peak RSS, and whether it said it was catching up
  ssh_round_s       one parallel round of `ssh host python3 -c 'import json'` to every host name
  status_s, down_s  wall time of `fleet status --json` (median of 3) and of `fleet down --yes`
                    (Python start included), against that round
  load              the machine's 1-minute load average after the storm

    python bench/launch_storm.py --hosts 16 32 64 --stop 120 --json docs/results/launch-storm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fleet.config import load_config
from fleet.state import State
from fleet.supervisor import Supervisor
from bench.ssh_latency import write_config
from tests.sshd_server import start_sshd

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def storm(config_path: str, timeout: float) -> dict:
    config = load_config(config_path)
    logs: list[str] = []
    unreachable: dict[str, str] = {}
    sup = Supervisor(config, on_log=logs.append)
    await sup.prepare(say=lambda line: None, step=lambda line: None)
    await sup.start()

    def watch() -> None:
        for n, link in sup.links.items():
            if link.host.reachable is False:
                unreachable.setdefault(n, link.host.error or "?")
    sup.on_change = watch
    cpu0, t0 = cpu_s(), time.monotonic()
    await sup.launch_all()
    all_running = None
    while time.monotonic() - t0 < timeout:
        snap = sup.snapshot()
        watch()
        if all(s.state == State.RUNNING for s in snap.shards):
            all_running = time.monotonic() - t0
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(10)
    cpu = cpu_s() - cpu0
    snap = sup.snapshot()
    false = [s.id for s in snap.shards if s.failures or s.restarts or
             any(f for f in sup.shards[s.id].launch_failures)]
    await sup.close()
    return {"shards": len(snap.shards), "all_running_s": round(all_running, 2) if all_running else None,
            "false_failures": len(false), "unreachable": len(unreachable),
            "unreachable_why": sorted(set(unreachable.values()))[:5],
            "supervisor_cpu_s": round(cpu, 2),
            "launch_failed_logs": sum("failed" in m for m in logs)}


FALSE_VERDICTS = ("-> STALLED", "-> FAILED", "-> BACKOFF", "-> UNKNOWN", "-> FATAL", "unreachable", "(auto)")


def proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds, peak RSS bytes) of a live process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/status") as f:
        hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return cpu, hwm


def stopped_supervisor(cfg: str, stop_s: float) -> dict:
    """`fleet up --headless` re-attached to the storm, SIGSTOPped `stop_s` seconds, continued and
    watched 30 s: the false verdicts it printed."""
    import signal
    import threading
    proc = subprocess.Popen([sys.executable, "-m", "fleet", "up", "--headless", "-c", cfg], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(l.rstrip() for l in proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 600
    while not any("-> RUNNING" in l for l in lines) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(15)                                           # every host replayed and followed
    os.kill(proc.pid, signal.SIGSTOP)
    time.sleep(stop_s)
    os.kill(proc.pid, signal.SIGCONT)
    time.sleep(30)
    cpu, rss = proc_usage(proc.pid)
    proc.terminate()
    proc.wait(60)
    false = [l for l in lines if any(f in l for f in FALSE_VERDICTS)]
    return {"stop_s": stop_s, "false_verdicts": len(false), "false_lines": false[:5],
            "said_catching_up": any("catching up" in l for l in lines),
            "up_cpu_s": round(cpu, 2), "up_peak_rss_mb": round(rss / 1e6, 1)}


def ssh_round(server, hosts: int) -> float:
    """Wall time of one parallel `ssh host python3 -c 'import json'` to each of the host names."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["ssh", "-i", server.client_key, "-o", f"UserKnownHostsFile={server.known_hosts}",
                               "-o", "BatchMode=yes", "-p", str(server.port), "root@127.0.0.1",
                               sys.executable, "-c", "'import json'"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for _ in range(hosts)]
    for p in procs:
        p.wait(300)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, nargs="+", default=[16, 32])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--stop", type=float, default=0.0, help="seconds to SIGSTOP a re-attached fleet up (0: skip)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = {"machine": f"{os.cpu_count()} cores", "command": " ".join(["python", *sys.argv]), "runs": []}
    for hosts in args.hosts:
        tmp = tempfile.mkdtemp(prefix="fleet-storm-")
        server, proc = start_sshd(os.path.join(tmp, "sshd"))
        try:
            cfg = write_config(tmp, server, hosts, args.gpus, name="storm",
                               supervise="max_restarts = 3\nmax_concurrent_connects = 8")
            r = {"hosts": hosts, "gpus_per_host": args.gpus, **asyncio.run(storm(cfg, args.timeout))}
            walls = []
            for _ in range(3):
                t0 = time.perf_counter()
                s = subprocess.run([sys.executable, "-m", "fleet", "status", "--json", "-c", cfg], cwd=REPO,
                                   capture_output=True, text=True)
                walls.append(time.perf_counter() - t0)
                assert s.returncode in (0, 1), s.stderr
            r["status_s"] = round(statistics.median(walls), 2)
            r["ssh_round_s"] = round(statistics.median(ssh_round(server, hosts) for _ in range(3)), 2)
            r["load"] = round(os.getloadavg()[0], 1)
            if args.stop:
                r["stopped"] = stopped_supervisor(cfg, args.stop)
            t0 = time.perf_counter()
            d = subprocess.run([sys.executable, "-m", "fleet", "down", "--yes", "-c", cfg], cwd=REPO,
                               capture_output=True, timeout=900, text=True)
            r["down_s"], r["down_rc"] = round(time.perf_counter() - t0, 2), d.returncode
        finally:
            proc.terminate()
        print(json.dumps(r), flush=True)
        out["runs"].append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
