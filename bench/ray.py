"""The demo's rows through `[ray]` on 1, 2 and 4 local Ray nodes against the same rows over
`[[hosts]]` (issue 54), and a node lost half-way.

Each run is `fleet serve` on a fleet.toml of the demo's model and 600 rows (two shards, on the CPU,
OMP_NUM_THREADS=1), watched with `fleet status --json` once a second. Ray's nodes are started as a
user starts them (tests/ray_cluster.py: `ray start --head`, `ray start --address`, logical GPUs);
two shards need two of them, so with 4 nodes two are idle (Ray places the actors). Reports:

  all_running_s     from `fleet serve` until both shards are RUNNING (deploy, preflight, launch,
                    the actors placed and the model loaded)
  run_s             from `fleet serve` until the run is DONE
  supervisor_cpu_pct  the supervisor's CPU over the run, % of one core
  lost_node         (--lose, on 2 nodes) the node of the shard not on the head removed (its raylet SIGKILLed) once
                    half the rows are done: run_s then, against the same run without the loss
                    (the mean slot's end is half the work done by each of two slots at the
                    same rate: the loss costs the restart, the reload and the rows redone)
  load              the machine's 1-minute load average at the end

    python bench/ray.py --nodes 1 2 4 --lose --json docs/results/ray.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.launch_storm import proc_usage       # noqa: E402
from tests.ray_cluster import start_ray         # noqa: E402

DEMO = os.path.join(REPO, ".fleet-demo")


def toml(tmp: str, engine: str) -> str:
    text = f"""
[run]
name = "bench-{engine.split()[0].strip('[]')}"
model = "{DEMO}/model"
data = "{DEMO}/chat.jsonl"
output = "{tmp}/out"
layers = "speculators"
max_tokens_per_batch = 4096
device = "cpu"
demo = true
env = {{ OMP_NUM_THREADS = "1" }}

[expected]
alert_ratio = 0.3

[supervise]
stall_timeout = "120s"
backoff_base = "0.5s"
backoff_max = "2s"

{engine}
"""
    path = os.path.join(tmp, "fleet.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def fleet(env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleet", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def snapshot(env: dict, cfg: str) -> dict:
    try:
        return json.loads(fleet(env, "status", "--json", "-c", cfg).stdout)
    except ValueError:
        return {"shards": [], "totals": {}}


def one_run(engine: str, tmp: str, lose=None, timeout: float = 900) -> dict:
    """`fleet serve` on the demo's rows; `lose(snap)`: called each second, True once it has acted."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["FLEET_STATE_DIR"] = os.path.join(tmp, "state")
    cfg = toml(tmp, engine)
    t0 = time.monotonic()
    serve = subprocess.Popen([sys.executable, "-m", "fleet", "serve", "-c", cfg], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=open(os.path.join(tmp, "serve.log"), "w"))
    out: dict = {}
    cpu = 0.0                                   # the supervisor's CPU seconds as last read (it exits when
    try:                                        # the run ends, so read each second)
        while time.monotonic() - t0 < timeout:
            try:
                cpu = proc_usage(serve.pid)[0]
            except (OSError, StopIteration):    # gone, or a zombie: the last reading stands
                pass
            snap = snapshot(env, cfg)
            states = [s["state"] for s in snap.get("shards", [])]
            if "all_running_s" not in out and len(states) == 2 and all(s == "RUNNING" for s in states):
                out["all_running_s"] = round(time.monotonic() - t0, 1)
            if lose is not None and "lost_at_s" not in out and lose(snap):
                out["lost_at_s"] = round(time.monotonic() - t0, 1)
            if len(states) == 2 and all(s == "DONE" for s in states):
                out["run_s"] = round(time.monotonic() - t0, 1)
                out["supervisor_cpu_pct"] = round(100 * cpu / out["run_s"], 1)
                out["done"] = snap["totals"].get("done")
                break
            time.sleep(1.0)
        else:
            raise RuntimeError(f"{engine.split()[0]}: not DONE in {timeout:.0f}s; see {tmp}/serve.log")
    finally:
        fleet(env, "serve", "--stop", "-c", cfg)
        if serve.poll() is None:
            serve.terminate()
        serve.wait(60)
    out["load"] = round(os.getloadavg()[0], 1)
    return out


def ray_run(nodes: int, lose: bool) -> dict:
    """Two shards on `nodes` Ray nodes of one GPU each (one node: two GPUs)."""
    cluster = start_ray(head_gpus=2 if nodes == 1 else 1, head_cpus=2 if nodes == 1 else 1)
    try:
        for n in range(1, nodes):
            cluster.add_node(f"n{n}", gpus=1)
        tmp = tempfile.mkdtemp(prefix=f"fleet-ray{nodes}-")
        engine = (f'[ray]\naddress = "{cluster.address}"\nnum_cpus = 0\nshards = 2\n'
                  f'root = "{tmp}/fleet"\npython = "{sys.executable}"\npoll_interval = "1s"')
        victim = None

        def lose_half(snap: dict) -> bool:
            nonlocal victim
            done = sum(s.get("done", 0) for s in snap.get("shards", []))
            away = next((s for s in snap.get("shards", []) if not s["host"].startswith(("head-", "ray"))), None)
            if away is None or done < 300:
                return False
            victim = away["host"].rsplit("-", 1)[0]              # the node of a shard not on the head
            cluster.remove_node(victim)
            return True
        out = {"engine": "ray", "nodes": nodes, **one_run(engine, tmp, lose_half if lose else None)}
        if lose:
            out["lost_node"] = victim
        return out
    finally:
        cluster.stop()


def hosts_run() -> dict:
    tmp = tempfile.mkdtemp(prefix="fleet-hosts-")
    engine = f'[[hosts]]\nname = "local"\naddress = "local"\ngpus = [0, 1]\nroot = "{tmp}/fleet"'
    return {"engine": "hosts", "nodes": 1, **one_run(engine, tmp)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--lose", action="store_true", help="also a run on 2 nodes that loses one half-way")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    subprocess.run([sys.executable, "-m", "compileall", "-q", "fleet", "worker"], cwd=REPO, check=True)
    out = {"machine": f"{os.cpu_count()} cores", "command": " ".join(["python", *sys.argv]), "runs": []}
    runs = [hosts_run] + [lambda n=n: ray_run(n, False) for n in args.nodes] + \
        ([lambda: ray_run(2, True)] if args.lose else [])
    for run in runs:
        r = run()
        print(json.dumps(r), flush=True)
        out["runs"].append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
