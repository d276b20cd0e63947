"""Record real runs for tests/data/runs/: the README's demo through the real supervisor and runner,
with the faults the synthetic fleet (bench/synthetic_fleet.py) replays.

    python bench/record_runs.py WORKDIR          # ~4 minutes on 2 CPU cores; then copy the files
    python bench/record_runs.py WORKDIR fatal    # step 3 alone, once step 1 has made the demo model

What it does, in WORKDIR (a copy of the demo's fleet.toml, backoff 3 s):
  1. `fleet up --headless`; at 300 of shard 0's 1,200 rows its worker gets SIGKILL (kill -9: the
     runner records `exited` code -9, the supervisor restarts it by itself, `by` = auto, and the new
     attempt resumes); at 600 of shard 1's rows a user stop goes through `hostctl act` (what `k` in
     the live view sends: `stop` why = user, then `exited` stopped), so that `fleet up` ends with
     shard 1 STOPPED;
  2. `fleet up --headless` again: shard 1 is launched again (`by` = manual); at 900 of its rows
     `fleet restart 1` beside it (`stop` why = restart, then = launch; the next launch by = manual);
     both end DONE;
  3. a shard of a model with a weight missing, through the runner (`hostctl launch`): the worker
     refuses it (`failed` fatal = true, exit 2) as it would on every restart.
Writes WORKDIR/restarts-0.jsonl, restarts-1.jsonl (steps 1-2) and fatal-0.jsonl (step 3).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from worker import protocol  # noqa: E402


def events(path: str) -> list[dict]:
    return list(protocol.iter_jsonl(path)) if os.path.exists(path) else []


def done(path: str) -> int:
    return max((e.get("done", 0) for e in events(path) if e.get("event") == "progress"), default=0)


def wait(predicate, what: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def record_demo(work: str) -> None:
    """Steps 1 and 2."""
    toml = open(os.path.join(REPO, "fleet.toml")).read().replace(
        'max_restarts = 3', 'max_restarts = 3\nbackoff_base = "3s"\nbackoff_max = "3s"')
    config = os.path.join(work, "fleet.toml")
    with open(config, "w") as f:
        f.write(toml)
    env = {**os.environ, "PYTHONPATH": REPO}
    up = [sys.executable, "-m", "fleet", "up", "-c", config, "--headless"]
    run_dir = os.path.join(work, ".fleet-demo", "fleet", "demo")
    ev = [os.path.join(protocol.shard_dir(run_dir, k), protocol.EVENTS_FILE) for k in (0, 1)]

    first = subprocess.Popen(up, cwd=work, env=env)
    wait(lambda: done(ev[0]) >= 300, "shard 0 at 300 rows")
    pid = int(open(os.path.join(protocol.shard_dir(run_dir, 0), protocol.PID_FILE)).read())
    os.kill(pid, signal.SIGKILL)                              # the worker only: its runner records it
    print(f"record_runs: killed shard 0's worker (pid {pid})", flush=True)
    wait(lambda: done(ev[1]) >= 600, "shard 1 at 600 rows")
    stop = protocol.ShardAction(shard=1, kind="stop", why="user", grace=10.0)
    subprocess.run([sys.executable, "-m", "worker.hostctl", "act", "--run-dir", run_dir],
                   input=stop.to_json() + "\n", text=True, check=True, cwd=REPO, env=env)
    print("record_runs: a user stop of shard 1", flush=True)
    print(f"record_runs: first fleet up exited {first.wait()}", flush=True)
    second = subprocess.Popen(up, cwd=work, env=env)
    wait(lambda: done(ev[1]) >= 900, "shard 1 at 900 rows")
    subprocess.run([sys.executable, "-m", "fleet", "restart", "1", "-c", config], check=True, cwd=work, env=env)
    print(f"record_runs: second fleet up exited {second.wait()}", flush=True)
    for k in (0, 1):
        shutil.copy(ev[k], os.path.join(work, f"restarts-{k}.jsonl"))


def record_fatal(work: str) -> None:
    """Step 3 (after step 1 made the demo model): the model path is relative to WORKDIR, as the
    reason names it."""
    env = {**os.environ, "PYTHONPATH": REPO}
    from safetensors.torch import load_file, save_file
    model = os.path.join(work, "broken-model")
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(os.path.join(work, ".fleet-demo", "model"), model)
    weights = load_file(os.path.join(model, "model.safetensors"))
    del weights["model.layers.3.mlp.up_proj.weight"]
    save_file(weights, os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
    shard = os.path.join(work, "fatal", "shards", "0")
    shutil.rmtree(os.path.dirname(os.path.dirname(shard)), ignore_errors=True)
    subprocess.run([sys.executable, "-m", "worker.hostctl", "launch", "--shard-dir", shard, "--gpu", "0",
                    "--cwd", work, "--env", "OMP_NUM_THREADS=1", "--env", f"PYTHONPATH={REPO}", "--",
                    sys.executable, "-m", "worker.extract", "--model", "broken-model",
                    "--data", ".fleet-demo/chat.jsonl", "--out", "fatal/out", "--state", shard,
                    "--shard-index", "0", "--num-shards", "2", "--device", "cpu"], check=True, cwd=REPO, env=env)
    path = os.path.join(shard, protocol.EVENTS_FILE)
    wait(lambda: any(e.get("event") == "exited" for e in events(path)), "the broken model's shard to end")
    shutil.copy(path, os.path.join(work, "fatal-0.jsonl"))


def main(work: str, steps: str = "all") -> None:
    work = os.path.abspath(work)
    os.makedirs(work, exist_ok=True)
    if steps == "all":
        record_demo(work)
    record_fatal(work)
    print(json.dumps({k: [e["event"] for e in events(os.path.join(work, f"{k}.jsonl")) if e["event"] != "progress"]
                      for k in ("restarts-0", "restarts-1", "fatal-0")}, indent=1))


if __name__ == "__main__":
    main(*(sys.argv[1:] or ["/tmp/fleet-record"]))
