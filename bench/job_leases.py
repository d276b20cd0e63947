"""The run's end against the mean slot's end for a [job] whose slots run at 1x ... 3x (issue 33):
fixed shards against the same job taking its rows ({start}/{end}), through `fleet up --headless`.

Eight local "GPUs" run tests/jobs/rows_job.py, which sleeps `--sleep` seconds a row (times the
slot's factor, 1 + 2k/7 for slot k: 1x ... 3x, an older card, a throttled one) and appends each
row it finishes, with its slot and time, to one file. A slot's end is its last row's time; the
run's end is the last slot's; both from the first row of the run. "fixed": the command computes
its shard's own range (`--fixed`), as a job that does not take its rows; "leases": the command
takes `{start}`/`{end}` and the runner shares the host's rows (worker/ranged.py).

    python3 bench/job_leases.py [--rows 4000] [--sleep 0.02] [--min-chunk N]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROWS_JOB = os.path.join(REPO, "tests", "jobs", "rows_job.py")
SLOTS = 8


def fleet_toml(tmp: str, rows: int, sleep: float, leases: bool, min_chunk: int | None) -> str:
    out = os.path.join(tmp, "out")
    slow = " ".join(f"--slow {k}={1 + 2 * k / (SLOTS - 1):.3f}" for k in range(SLOTS))
    rows_args = "{start} {end}" if leases else "0 0"
    fixed = "" if leases else f" --fixed {rows}:{SLOTS}"
    job_rows = f"rows = {rows}\n" + (f"min_chunk = {min_chunk}\n" if min_chunk else "") if leases else ""
    path = os.path.join(tmp, "fleet.toml")
    with open(path, "w") as f:
        f.write(f"""
[run]
name = "bench"
output = "{out}"

[job]
command = "{sys.executable} {ROWS_JOB} {out} {rows_args} {{shard}} --sleep {sleep} {slow}{fixed}"
done = "ALL DONE"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"
{job_rows}
[[hosts]]
name = "local"
address = "local"
gpus = {list(range(SLOTS))}
root = "{os.path.join(tmp, 'fleet')}"
""")
    return path


def run(rows: int, sleep: float, leases: bool, min_chunk: int | None) -> tuple[list[float], int]:
    """Each slot's end (s from the run's first row) and how many times the command ran."""
    with tempfile.TemporaryDirectory() as tmp:
        config = fleet_toml(tmp, rows, sleep, leases, min_chunk)
        r = subprocess.run([sys.executable, "-m", "fleet.cli", "up", "--headless", "-c", config], cwd=REPO,
                           capture_output=True, text=True, timeout=3600)
        if r.returncode != 0:
            raise SystemExit(f"fleet up failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        written = [line.split() for line in open(os.path.join(tmp, "out", "rows.txt"))]
        if sorted(int(i) for i, _, _ in written) != list(range(rows)):
            raise SystemExit("rows missing or written twice")
        first = min(float(t) for _, _, t in written)
        ends = [max(float(t) for _, s, t in written if int(s) == k) - first for k in range(SLOTS)]
        runs = sum(open(os.path.join(tmp, "fleet", "bench", "shards", str(k), "log")).read().count(": rows ")
                   for k in range(SLOTS)) if leases else SLOTS
        return ends, runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--sleep", type=float, default=0.02, help="seconds a row on the fastest slot")
    p.add_argument("--min-chunk", type=int, default=None, help="[job] min_chunk (default: 1%% of a shard's rows)")
    args = p.parse_args()
    print(f"{SLOTS} slots at 1x..3x, {args.rows} rows, {args.sleep}s a row on the fastest")
    print("| rows | slots' ends (s) | runs of the command | run's end (s) | mean slot's end (s) | run past the mean |")
    print("|---|---|---:|---:|---:|---:|")
    for leases in (False, True):
        ends, runs = run(args.rows, args.sleep, leases, args.min_chunk)
        mean = sum(ends) / len(ends)
        print(f"| {'leases ({start}/{end})' if leases else 'fixed'} | {', '.join(f'{e:.1f}' for e in ends)} | "
              f"{runs} | {max(ends):.1f} | {mean:.1f} | {100 * (max(ends) / mean - 1):+.1f}% |", flush=True)


if __name__ == "__main__":
    main()
