"""The run's end against the mean shard's end, fixed shards against a host's shared leases (issue 33).

Three worker processes of one host on the CPU over the tiny demo model, as fleet launches them
(CUDA_VISIBLE_DEVICES = the shard's GPU), shard k slowed by `k x --slow` seconds per forward
(tests/faults/inject: a throttled or older card): once with fixed shards (no --pool), once with
`--pool 0,1,2`. For each: every shard's end (its `done` event) from the first shard's start, the
run's end (the last), and how far the run's end is past the mean shard's end.

    python3 bench/leases.py [--rows 900] [--slow 0.05]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
INJECT = os.path.join(REPO, "tests", "faults", "inject")
SLOTS = 3


def run(tmp: str, model: str, data: str, pooled: bool, slow: float) -> dict[int, float]:
    out, procs = os.path.join(tmp, "out"), {}
    for k in range(SLOTS):
        argv = [sys.executable, "-m", "worker.extract", "--model", model, "--data", data, "--out", out,
                "--state", os.path.join(tmp, "run", "shards", str(k)), "--shard-index", str(k),
                "--num-shards", str(SLOTS), "--model-dtype", "fp32", "--max-tokens-per-batch", "256",
                "--device", "cpu"] + (["--pool", "0,1,2"] if pooled else [])
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{INJECT}", "CUDA_VISIBLE_DEVICES": str(k),
               "OMP_NUM_THREADS": "1", "FLEET_INJECT_SLOW_GPU": f"{k}:{k * slow}"}
        procs[k] = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for k, p in procs.items():
        if p.wait() != 0:
            raise SystemExit(f"shard {k} failed: see {tmp}/run/shards/{k}/events.jsonl")
    ends, starts = {}, []
    for k in range(SLOTS):
        events = [json.loads(l) for l in open(os.path.join(tmp, "run", "shards", str(k), "events.jsonl"))]
        starts.append(next(e["t"] for e in events if e["event"] == "started"))
        ends[k] = next(e["t"] for e in events if e["event"] == "done")
    return {k: t - min(starts) for k, t in ends.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=900)
    p.add_argument("--slow", type=float, default=0.05, help="seconds per forward added per shard index")
    args = p.parse_args()
    from worker.demo import make_model, make_token_dataset
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(os.path.join(tmp, "model"), layers=4)
        data = make_token_dataset(os.path.join(tmp, "d.jsonl"), args.rows, vocab_size=500, mean_tokens=40, seed=2)
        print(f"{SLOTS} shards, {args.rows} rows, shard k slowed by k x {args.slow}s a forward")
        print("| shards | each shard's end (s) | run's end (s) | past the mean shard's end |")
        print("|---|---|---:|---:|")
        for pooled in (False, True):
            sub = os.path.join(tmp, "pool" if pooled else "fixed")
            os.makedirs(sub)
            ends = run(sub, model, data, pooled, args.slow)
            mean, last = sum(ends.values()) / len(ends), max(ends.values())
            print(f"| {'leases (--pool)' if pooled else 'fixed'} | "
                  + ", ".join(f"{ends[k]:.1f}" for k in sorted(ends))
                  + f" | {last:.1f} | {100 * (last - mean) / mean:+.1f}% |")


if __name__ == "__main__":
    main()
