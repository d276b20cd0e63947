"""Slurm as the launcher, on the login node: submit shards as one job array, cancel them, and ask
Slurm what only it knows. Standard library only: it runs wherever `sbatch`, `squeue` and `scancel`
are, next to the run's folder on the shared filesystem.

    python -m worker.slurm check [--partition P] [--account A] [--shards N]
    python -m worker.slurm submit --run-dir R            (the submission as JSON on stdin)
    python -m worker.slurm cancel --run-dir R --shard K [--why user|restart] [--reason TEXT] [--timeout S]
    python -m worker.slurm cancel-all --run-dir R [--job-name N] [--timeout S]

A submission writes, for every shard it covers, `launch` (numbered as hostctl numbers them,
`launcher = "slurm"`) into the shard's record, then its part of the submission file (argv,
environment, sentinels, the launch number), then runs one `sbatch --array`. The job's id is then
recorded as `submitted`; a refusal as `failed` + `exited`, so the judge backs off and retries it
under the restart policy like any failed attempt. Inside each array task `python -m worker.hostctl
task` runs the shard exactly as the SSH runner does (lock, `started`, sentinels, `exited`).

What Slurm alone knows is read with `squeue` (and `sacct` when the cluster keeps accounting):
live states are the agent's to report; a task's final state is recorded once as `slurm_end`, with
`exited` (vanished) when the task never recorded its own end (a node that died, a job cancelled
while queued). Every Slurm command is an argv: no shell sees a value from fleet.toml.
"""

from __future__ import annotations

import argparse
import fcntl
import getpass
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

from . import protocol
from .files import write_atomic
from .launches import LaunchState
from .text import ranges_text
from .text import last_line

# Final states of a job (sacct/squeue names). A task in any other state is alive in Slurm: queued,
# running, completing, suspended, requeued or held.
TERMINAL = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                      "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "REVOKED", "UNKNOWN"})
# Live states in which a task waits in Slurm's queue (held, or requeued) rather than runs.
WAITING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"})
SLURM_DIR = "slurm"                 # <run>/slurm: the task script, submission files, the lock
SQUEUE_FORMAT = "%i|%T|%N|%r"       # job (<array>_<index>), state, nodes, reason (last: may hold commas)
SLURM_TIMEOUT_S = 60                # one Slurm command


class SlurmError(Exception):
    """Slurm did not answer (controller down, command missing); the message is its last line."""


@dataclass(frozen=True)
class View:
    """One task as Slurm shows it now."""
    job: str
    state: str
    reason: str | None = None
    node: str | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def live(self) -> bool:
        return not self.terminal


def _reason(text: str) -> str | None:
    text = text.strip()
    return None if text in ("", "None", "(null)") else text


def _run(argv: list[str], timeout: float = SLURM_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise SlurmError(f"{argv[0]} not found on this node (is Slurm's client installed and on PATH?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]} did not answer within {timeout:.0f}s") from None


def parse_squeue(text: str) -> dict[str, View]:
    """`squeue -h -r -o '%i|%T|%N|%r'` lines -> job -> View."""
    views = {}
    for line in text.splitlines():
        parts = line.split("|", 3)
        if len(parts) != 4 or not parts[0].strip():
            continue
        job, state, node, reason = (p.strip() for p in parts)
        views[job] = View(job, state.split()[0] if state else "UNKNOWN", _reason(reason), node or None)
    return views


def _covers(spec: str, index: int) -> bool:
    """Does an array range like "0-3,7%2" hold `index`?"""
    for part in spec.split("%")[0].split(","):
        a, _, b = part.partition("-")
        try:
            if int(a) <= index <= int(b or a):
                return True
        except ValueError:
            continue
    return False


def task_views(listed: dict[str, View], jobs: list[str]) -> dict[str, View]:
    """Each of `jobs` ("<array id>_<index>") from what Slurm listed: its own line, or the line of
    the array's tasks never split out of it ("<id>_[0-3]", or "<id>" once Slurm has ended the
    whole remainder, e.g. cancelled while queued)."""
    out = {}
    for job in jobs:
        if job in listed:
            out[job] = listed[job]
            continue
        array, _, index = job.partition("_")
        for name, view in listed.items():
            rest = name[len(array):]
            if name == array or (rest.startswith("_[") and index.isdigit() and _covers(rest[2:-1], int(index))):
                out[job] = View(job, view.state, view.reason, view.node)
                break
    return out


def squeue(jobs: list[str]) -> dict[str, View]:
    """What Slurm's controller says now of these tasks (finished ones for MinJobAge, 300 s by
    default), asked by array. A task it does not list is absent from the result."""
    if not jobs:
        return {}
    arrays = sorted({j.partition("_")[0] for j in jobs})
    r = _run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(arrays), "-o", SQUEUE_FORMAT])
    if r.returncode != 0:
        if "Invalid job id" in r.stderr:         # none of them is known any more
            return {}
        raise SlurmError(f"squeue failed: {last_line(r.stderr or r.stdout)}")
    return task_views(parse_squeue(r.stdout), jobs)


def parse_sacct(text: str) -> dict[str, View]:
    """`sacct -n -P -X -o JobID,State,NodeList,Reason` lines -> job -> View ("CANCELLED by 0" ->
    CANCELLED)."""
    views = {}
    for line in text.splitlines():
        parts = line.split("|")
        if len(parts) < 4 or not parts[0].strip():
            continue
        job, state, node, reason = (p.strip() for p in parts[:4])
        state = state.split()[0] if state else "UNKNOWN"
        views[job] = View(job, state, _reason(reason), None if node in ("", "None assigned") else node)
    return views


def sacct(jobs: list[str]) -> dict[str, View] | None:
    """What Slurm's accounting remembers of these tasks; None when the cluster keeps none (then
    `sacct` fails: "Slurm accounting storage is disabled")."""
    if not jobs or shutil.which("sacct") is None:
        return None
    arrays = sorted({j.partition("_")[0] for j in jobs})
    try:
        r = _run(["sacct", "-n", "-P", "-X", "-j", ",".join(arrays), "-o", "JobID,State,NodeList,Reason"])
    except SlurmError:
        return None
    if r.returncode != 0:
        return None
    return task_views(parse_sacct(r.stdout), jobs)


def views_of(jobs: list[str]) -> dict[str, View]:
    """Every one of `jobs` as Slurm sees it: squeue first, sacct for those it no longer lists, and
    UNKNOWN (with why) for a task neither knows. Call it only for tasks whose `submitted` was read
    before the call: then "not listed" means gone, not "not yet". Raises SlurmError."""
    views = squeue(jobs)
    missing = [j for j in jobs if j not in views]
    if missing:
        old = sacct(missing)
        for j in missing:
            if old is not None and j in old:
                views[j] = old[j]
            else:
                views[j] = View(j, "UNKNOWN", "Slurm no longer lists the task" +
                                ("" if old is not None else " (and keeps no accounting: no sacct)"))
    return views


# --- a shard's record, as far as Slurm is concerned --------------------------------------------

def events_path(shard_dir: str) -> str:
    return os.path.join(shard_dir, protocol.EVENTS_FILE)


def record_end(shard_dir: str, view: View) -> list[protocol.Record]:
    """Record Slurm's final state of the newest launch's task (once), and its end if the task never
    recorded one. Re-reads the record first: the task's runner writes `exited` before its job
    ends, so what is read after a final state is everything the task will ever write."""
    path = events_path(shard_dir)
    state = LaunchState.read(path)
    if not state.n or state.job != view.job:
        return []
    written: list[protocol.Record] = []
    if not state.slurm_ended:           # a task that never ran keeps its queue reason: not why it ended
        written.append(protocol.SlurmEnded(launch=state.n, job=view.job, state=view.state,
                                           reason=view.reason if view.node or view.state == "UNKNOWN" else None,
                                           node=view.node))
    if not state.ended:
        written.append(protocol.Exited(launch=state.n, vanished=True))
    for ev in written:
        protocol.append_jsonl(path, ev)
    return written


class RunLock:
    """`<run>/slurm/lock`: one submission or cancellation of the run at a time on the login node,
    and the agent's proof that no submission is half done."""

    def __init__(self, run_dir: str):
        folder = os.path.join(run_dir, SLURM_DIR)
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "lock")
        self.fd: int | None = None

    def acquire(self, wait: float = 120.0) -> bool:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    self.fd = None
                    return False
                time.sleep(0.05)

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        if not self.acquire():
            raise SlurmError(f"another fleet command holds {self.path} for over 120s")
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def settle_unended(shard_dir: str, state: LaunchState, views: dict[str, View]) -> str | None:
    """Before a new launch: the newest one must be over. Returns "queued"/"running" when Slurm still
    holds its task (nothing to do), or None after recording the end of a task Slurm has finished
    (or of a submission that never reached Slurm)."""
    if state.ended or not state.n:
        return None
    if state.job is None:                       # the submitter died between launch and sbatch
        protocol.append_jsonl(events_path(shard_dir), protocol.Failed(
            launch=state.n, reason="the submission never reached Slurm"))
        protocol.append_jsonl(events_path(shard_dir), protocol.Exited(launch=state.n, vanished=True))
        return None
    view = views.get(state.job)
    if view is not None and view.live:
        return "queued" if view.state in WAITING else "running"
    record_end(shard_dir, view or View(state.job, "UNKNOWN", "Slurm no longer lists the task"))
    return None


# --- submitting ----------------------------------------------------------------------------------

TASK_SCRIPT = """#!/bin/sh
# fleet: one array task = one shard. worker.hostctl task reads this task's part of the submission
# file ($3) and runs the shard as the SSH runner does. Written by python -m worker.slurm.
PYTHONPATH="$1"
export PYTHONPATH
exec "$2" -m worker.hostctl task --submission "$3"
"""


def array_spec(indices: list[int], max_parallel: int | None) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (+ "%M", Slurm's throttle of tasks running at once)."""
    return ranges_text(indices) + (f"%{max_parallel}" if max_parallel else "")


def task_script(run_dir: str) -> str:
    path = os.path.join(run_dir, SLURM_DIR, "task.sh")
    try:
        current = open(path).read()
    except OSError:
        current = None
    if current != TASK_SCRIPT:
        write_atomic(path, TASK_SCRIPT, 0o755)
    return path


def submit(run_dir: str, spec: dict) -> protocol.SlurmSubmitted:
    """Submit `spec["tasks"]` (shard -> argv, env, cwd, sentinels) as one array. Shards whose newest
    launch Slurm still holds are left alone ("never twice"); the others get a launch each."""
    by = spec.get("by", "manual")
    tasks = {k: protocol.LaunchSpec.from_dict(v, f"tasks.{k}") for k, v in spec["tasks"].items()}
    result: dict[str, str] = {}
    with RunLock(run_dir):
        states = {k: LaunchState.read(events_path(protocol.shard_dir(run_dir, int(k)))) for k in tasks}
        jobs = [s.job for s in states.values() if not s.ended and s.job]
        views = views_of(jobs) if jobs else {}
        launches: dict[str, int] = {}
        for k, state in states.items():
            shard_dir = protocol.shard_dir(run_dir, int(k))
            os.makedirs(shard_dir, mode=0o755, exist_ok=True)
            held = settle_unended(shard_dir, state, views)
            if held:
                result[k] = held
                continue
            n = LaunchState.read(events_path(shard_dir)).n + 1
            protocol.append_jsonl(events_path(shard_dir), protocol.Launch(
                launch=n, by=by, gpu=None, argv=tasks[k].argv, launcher="slurm"))
            launches[k] = n
        if not launches:
            return protocol.SlurmSubmitted(status="held", shards=result)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        submission = os.path.join(run_dir, SLURM_DIR, f"submit-{stamp}.json")
        write_atomic(submission, json.dumps({
            "run_dir": run_dir, "by": by,
            "tasks": {k: {**tasks[k].to_dict(), "launch": n} for k, n in launches.items()}}), 0o600)
        argv = ["sbatch", "--parsable", f"--job-name={spec['job_name']}",
                f"--array={array_spec([int(k) for k in launches], spec.get('max_parallel'))}",
                f"--output={os.path.join(run_dir, 'shards', '%a', protocol.LOG_FILE)}",
                "--open-mode=append", "--no-requeue", *spec.get("sbatch", []),
                task_script(run_dir), spec["pythonpath"], spec["python"], submission]
        try:
            r = _run(argv)
            error = None if r.returncode == 0 else f"sbatch refused: {last_line(r.stderr or r.stdout)}"
        except SlurmError as e:
            r, error = None, str(e)
        if error is None:
            job = r.stdout.strip().split(";")[0].strip()
            if not job.isdigit():
                error = f"sbatch printed no job id: {last_line(r.stdout)}"
        for k, n in launches.items():
            path = events_path(protocol.shard_dir(run_dir, int(k)))
            if error is None:
                protocol.append_jsonl(path, protocol.Submitted(launch=n, job=f"{job}_{k}"))
                result[k] = "submitted"
            else:
                protocol.append_jsonl(path, protocol.Failed(launch=n, reason=error))
                protocol.append_jsonl(path, protocol.Exited(launch=n))
                result[k] = "refused"
        if error is not None:
            return protocol.SlurmSubmitted(status="error", error=error, shards=result)
        return protocol.SlurmSubmitted(status="submitted", job=job, argv=shlex.join(argv), shards=result)


# --- cancelling ------------------------------------------------------------------------------------

def _scancel(jobs: list[str], extra: list[str] | None = None) -> str | None:
    if not jobs and not extra:
        return None
    r = _run(["scancel", *(extra or []), *jobs])
    if r.returncode != 0 and "Invalid job id" not in r.stderr and "already completing" not in r.stderr:
        return f"scancel failed: {last_line(r.stderr or r.stdout)}"
    return None


def _wait_final(jobs: list[str], timeout: float) -> dict[str, View]:
    """Poll until every one of `jobs` is in a final state (after COMPLETING: its task wrote what it
    will write) or `timeout` passes; the last views."""
    deadline = time.monotonic() + timeout
    while True:
        views = views_of(jobs)
        if all(views[j].terminal for j in jobs) or time.monotonic() >= deadline:
            return views
        time.sleep(0.3)


def cancel(run_dir: str, shard: int, why: str, reason: str | None, timeout: float,
           then: str | None = None, by: str | None = None) -> protocol.SlurmCancelled:
    """`stop` first (the intent: the user's or the run's stop, a restart's, the policy giving up),
    then scancel of the shard's task; returns once Slurm says it is over (its end recorded), or
    "cancelling" after `timeout`. A user's stop of a shard that is not running is still recorded:
    a shard waiting to be resubmitted is STOPPED."""
    shard_dir = protocol.shard_dir(run_dir, shard)
    with RunLock(run_dir):
        state = LaunchState.read(events_path(shard_dir))
        if state.ended or not state.n:
            if why in protocol.USER_STOPS:
                os.makedirs(shard_dir, mode=0o755, exist_ok=True)
                protocol.append_jsonl(events_path(shard_dir), protocol.StopRequested(
                    launch=state.n or None, why=why, reason=reason))
            return protocol.SlurmCancelled(status="not running")
        protocol.append_jsonl(events_path(shard_dir), protocol.StopRequested(
            launch=state.n, why=why, reason=reason, then=then, by=by))
        if state.job is None:
            settle_unended(shard_dir, state, {})
            return protocol.SlurmCancelled(status="stopped")
        error = _scancel([state.job])
        if error:
            return protocol.SlurmCancelled(status="error", error=error)
        view = _wait_final([state.job], timeout)[state.job]
        if not view.terminal:
            return protocol.SlurmCancelled(status="cancelling", job=state.job, state=view.state)
        record_end(shard_dir, view)
        return protocol.SlurmCancelled(status="stopped", job=state.job, state=view.state)


def cancel_all(run_dir: str, job_name: str | None, timeout: float) -> protocol.SlurmCancelled:
    """Every live shard of the run: `stop` (the user's) in its record, then one scancel of all their
    tasks, and of any other job of the run's name (a submission whose id was never recorded)."""
    folder = os.path.join(run_dir, "shards")
    shards = sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []
    out: dict[str, str] = {}
    with RunLock(run_dir):
        live: dict[int, LaunchState] = {}
        for k in shards:
            state = LaunchState.read(events_path(protocol.shard_dir(run_dir, k)))
            protocol.append_jsonl(events_path(protocol.shard_dir(run_dir, k)),   # a shard waiting to
                                  protocol.StopRequested(launch=state.n or None, why="run"))  # be resubmitted too
            if state.ended or not state.n:
                out[str(k)] = "not running"
                continue
            live[k] = state
        jobs = [s.job for s in live.values() if s.job]
        error = _scancel(jobs, [f"--name={job_name}", f"--user={getpass.getuser()}"] if job_name else None)
        if error:
            return protocol.SlurmCancelled(status="error", error=error)
        views = _wait_final(jobs, timeout) if jobs else {}
        for k, state in live.items():
            shard_dir = protocol.shard_dir(run_dir, k)
            if state.job is None:
                settle_unended(shard_dir, state, {})
                out[str(k)] = "stopped"
            elif views[state.job].terminal:
                record_end(shard_dir, views[state.job])
                out[str(k)] = "stopped"
            else:
                out[str(k)] = "cancelling"
    return protocol.SlurmCancelled(status="cancelled", shards=out)


# --- inside a task -------------------------------------------------------------------------------

def allocated_gpus(env: dict | None = None) -> list[int] | None:
    """The node's GPU indices Slurm gave this task (SLURM_STEP_GPUS / SLURM_JOB_GPUS), else those
    CUDA_VISIBLE_DEVICES names by number; None when nothing says."""
    env = os.environ if env is None else env
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = env.get(var, "").strip()
        if value:
            try:
                return [int(x) for x in value.split(",") if x.strip()]
            except ValueError:
                continue
    return None


def own_gpus(readings: list[protocol.GpuStat], allocated: list[int] | None,
             visible: str | None) -> list[protocol.GpuStat]:
    """The task's own GPUs among NVML's readings of its node: by index when Slurm said which, by
    UUID when CUDA_VISIBLE_DEVICES holds UUIDs; all readable ones when nothing says (a node whose
    cgroup already hides the others)."""
    uuids = [x.strip() for x in (visible or "").split(",") if x.strip().startswith(("GPU-", "MIG-"))]
    if uuids:
        mine = [g for g in readings if g.uuid in uuids]
        if mine:
            return mine
    if allocated is not None:
        mine = [g for g in readings if g.index in allocated]
        if mine:
            return mine
    return [g for g in readings if not g.lost]


# --- checking the login node -------------------------------------------------------------------

def check(partition: str | None, account: str | None, shards: int | None) -> protocol.SlurmCheck:
    report = protocol.SlurmCheck()

    def say(level: str, message: str) -> None:
        report.checks.append(protocol.Check(level, message))

    missing = [c for c in ("sbatch", "squeue", "scancel") if shutil.which(c) is None]
    if missing:
        say("error", f"{', '.join(missing)} not found on the login node (Slurm's client commands)")
        return report
    try:
        r = _run(["scontrol", "show", "config"])
        if r.returncode != 0:
            say("error", f"Slurm does not answer: {last_line(r.stderr or r.stdout)}")
            return report
        conf = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", r.stdout, re.M))
        report.slurm_version = conf.get("SLURM_VERSION")
        size = conf.get("MaxArraySize", "")
        if size.isdigit() and shards and shards > int(size) - 1:
            say("error", f"shards = {shards}, but this cluster's MaxArraySize is {size} (array "
                         f"indices up to {int(size) - 1}): lower shards")
        if partition:
            p = _run(["scontrol", "show", "partition", partition, "-o"])
            if p.returncode != 0 or not p.stdout.strip():
                say("error", f"partition {partition} unknown to Slurm: {last_line(p.stderr or p.stdout)}")
    except SlurmError as e:
        say("error", str(e))
    report.sacct = sacct(["1"]) is not None
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.slurm")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--partition", default=None)
    c.add_argument("--account", default=None)
    c.add_argument("--shards", type=int, default=None)
    s = sub.add_parser("submit")
    s.add_argument("--run-dir", required=True)
    k = sub.add_parser("cancel")
    k.add_argument("--run-dir", required=True)
    k.add_argument("--shard", type=int, required=True)
    k.add_argument("--why", choices=("user", "run", "restart", "fatal"), default="user")
    k.add_argument("--reason", default=None)
    k.add_argument("--then", choices=("launch",), default=None, help="a restart: resubmitted once it ended")
    k.add_argument("--by", choices=("manual", "auto"), default=None)
    k.add_argument("--timeout", type=float, default=60.0)
    a = sub.add_parser("cancel-all")
    a.add_argument("--run-dir", required=True)
    a.add_argument("--job-name", default=None)
    a.add_argument("--timeout", type=float, default=60.0)
    args = ap.parse_args(argv)
    os.umask(os.umask(0o022) | 0o022)
    result: protocol.Reply
    try:
        if args.cmd == "check":
            result = check(args.partition, args.account, args.shards)
        elif args.cmd == "submit":
            result = submit(args.run_dir, json.loads(sys.stdin.read()))
        elif args.cmd == "cancel":
            result = cancel(args.run_dir, args.shard, args.why, args.reason, args.timeout, args.then, args.by)
        else:
            result = cancel_all(args.run_dir, args.job_name, args.timeout)
    except SlurmError as e:
        result = (protocol.SlurmCheck(checks=[protocol.Check("error", str(e))]) if args.cmd == "check"
                  else protocol.SlurmSubmitted(error=str(e)) if args.cmd == "submit"
                  else protocol.SlurmCancelled(error=str(e)))
    print(result.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
