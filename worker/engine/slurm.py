"""Slurm, on the login node: shards as one job array, asked about with `squeue` (and `sacct` when
the cluster keeps accounting), ended with `scancel`. Standard library only: it runs wherever
`sbatch`, `squeue` and `scancel` are, next to the run's folder on the shared filesystem. What every
engine of tasks shares (the records, the lock, cancelling, the command line) is worker/engine/tasks.py;
this module translates Slurm's states into its neutral words.

    python -m worker.engine.slurm [--options JSON] check [--shards N]
    python -m worker.engine.slurm submit --run-dir R            (the submission as JSON on stdin)
    python -m worker.engine.slurm cancel --run-dir R --shard K [--why user|restart] [--reason TEXT]
    python -m worker.engine.slurm cancel-all --run-dir R [--job-name N] [--timeout S]

A task's final state is recorded once as `task_end`, with `exited` (vanished) when the task never
recorded its own end (a node that died, a job cancelled while queued). Every Slurm command is an
argv: no shell sees a value from fleet.toml.
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping

from .. import protocol
from ..files import write_atomic
from ..text import last_line, ranges_text
from .tasks import ENGINE_DIR, Engine, EngineError, TaskPlace, View, gpu_indices, main as tasks_main, unknown

# Slurm's final states (sacct/squeue names), as the neutral ends of protocol.TASK_ENDS. A task in
# any other state is alive in Slurm: queued, running, completing, suspended, requeued or held.
ENDS = {"COMPLETED": "completed", "FAILED": "failed", "CANCELLED": "cancelled", "TIMEOUT": "time_limit",
        "NODE_FAIL": "node_lost", "PREEMPTED": "preempted", "BOOT_FAIL": "boot_failed", "DEADLINE": "deadline",
        "OUT_OF_MEMORY": "out_of_memory", "REVOKED": "revoked", "UNKNOWN": "unknown"}
# Live states in which a task waits in Slurm's queue (held, or requeued) rather than runs.
WAITING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD",
                     "CONFIGURING"})
ENDING = frozenset({"COMPLETING", "STAGE_OUT", "SIGNALING"})
SQUEUE_FORMAT = "%i|%T|%N|%r"       # job (<array>_<index>), state, nodes, reason (last: may hold commas)
SLURM_TIMEOUT_S = 60                # one Slurm command


def view(job: str, state: str, reason: str | None = None, node: str | None = None) -> View:
    """A task in Slurm's words as a neutral View."""
    if state in ENDS:
        return View(job, "ended", state, reason, node, ENDS[state])
    return View(job, "queued" if state in WAITING else "ending" if state in ENDING else "running",
                state, reason, node)


def _reason(text: str) -> str | None:
    text = text.strip()
    return None if text in ("", "None", "(null)") else text


def _run(argv: list[str], timeout: float = SLURM_TIMEOUT_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise EngineError(f"{argv[0]} not found on this node (is Slurm's client installed and on PATH?)") from None
    except subprocess.TimeoutExpired:
        raise EngineError(f"{argv[0]} did not answer within {timeout:.0f}s") from None


def parse_squeue(text: str) -> dict[str, View]:
    """`squeue -h -r -o '%i|%T|%N|%r'` lines -> job -> View."""
    views = {}
    for line in text.splitlines():
        parts = line.split("|", 3)
        if len(parts) != 4 or not parts[0].strip():
            continue
        job, state, node, reason = (p.strip() for p in parts)
        views[job] = view(job, state.split()[0] if state else "UNKNOWN", _reason(reason), node or None)
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
        for name, found in listed.items():
            rest = name[len(array):]
            if name == array or (rest.startswith("_[") and index.isdigit() and _covers(rest[2:-1], int(index))):
                out[job] = View(job, found.phase, found.state, found.reason, found.node, found.end)
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
        raise EngineError(f"squeue failed: {last_line(r.stderr or r.stdout)}")
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
        views[job] = view(job, state, _reason(reason), None if node in ("", "None assigned") else node)
    return views


def sacct(jobs: list[str]) -> dict[str, View] | None:
    """What Slurm's accounting remembers of these tasks; None when the cluster keeps none (then
    `sacct` fails: "Slurm accounting storage is disabled")."""
    if not jobs or shutil.which("sacct") is None:
        return None
    arrays = sorted({j.partition("_")[0] for j in jobs})
    try:
        r = _run(["sacct", "-n", "-P", "-X", "-j", ",".join(arrays), "-o", "JobID,State,NodeList,Reason"])
    except EngineError:
        return None
    if r.returncode != 0:
        return None
    return task_views(parse_sacct(r.stdout), jobs)


def views_of(jobs: list[str]) -> dict[str, View]:
    """Every one of `jobs` as Slurm sees it: squeue first, sacct for those it no longer lists, and
    UNKNOWN (with why) for a task neither knows. Call it only for tasks whose `submitted` was read
    before the call: then "not listed" means gone, not "not yet". Raises EngineError."""
    views = squeue(jobs)
    missing = [j for j in jobs if j not in views]
    if missing:
        old = sacct(missing)
        for j in missing:
            if old is not None and j in old:
                views[j] = old[j]
            else:
                views[j] = unknown(j, "Slurm no longer lists the task" +
                                   ("" if old is not None else " (and keeps no accounting: no sacct)"))
    return views


# --- submitting ----------------------------------------------------------------------------------

TASK_SCRIPT = """#!/bin/sh
# fleet: one array task = one shard. worker.hostctl task reads this task's part of the submission
# file ($3) and runs the shard as the SSH runner does. Written by python -m worker.engine.slurm.
PYTHONPATH="$1"
export PYTHONPATH
exec "$2" -m worker.hostctl task --engine slurm --submission "$3"
"""


def array_spec(indices: list[int], max_parallel: int | None) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (+ "%M", Slurm's throttle of tasks running at once)."""
    return ranges_text(indices) + (f"%{max_parallel}" if max_parallel else "")


def task_script(run_dir: str) -> str:
    path = os.path.join(run_dir, ENGINE_DIR, "slurm-task.sh")
    try:
        current = open(path).read()
    except OSError:
        current = None
    if current != TASK_SCRIPT:
        write_atomic(path, TASK_SCRIPT, 0o755)
    return path


# --- cancelling ------------------------------------------------------------------------------------

def _scancel(jobs: list[str], extra: list[str] | None = None) -> str | None:
    if not jobs and not extra:
        return None
    r = _run(["scancel", *(extra or []), *jobs])
    if r.returncode != 0 and "Invalid job id" not in r.stderr and "already completing" not in r.stderr:
        return f"scancel failed: {last_line(r.stderr or r.stdout)}"
    return None


# --- inside a task -------------------------------------------------------------------------------

def allocated_gpus(env: Mapping[str, str] | None = None) -> list[int] | None:
    """The node's GPU indices Slurm gave this task (SLURM_STEP_GPUS / SLURM_JOB_GPUS), else those
    CUDA_VISIBLE_DEVICES names by number; None when nothing says."""
    env = os.environ if env is None else env
    for var in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        found = gpu_indices(env.get(var))
        if found is not None:
            return found
    return None


# --- checking the login node -------------------------------------------------------------------

def check(partition: str | None, account: str | None, shards: int | None) -> protocol.EngineCheck:
    report = protocol.EngineCheck()

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
        report.version = conf.get("SLURM_VERSION")
        size = conf.get("MaxArraySize", "")
        if size.isdigit() and shards and shards > int(size) - 1:
            say("error", f"shards = {shards}, but this cluster's MaxArraySize is {size} (array "
                         f"indices up to {int(size) - 1}): lower shards")
        if partition:
            p = _run(["scontrol", "show", "partition", partition, "-o"])
            if p.returncode != 0 or not p.stdout.strip():
                say("error", f"partition {partition} unknown to Slurm: {last_line(p.stderr or p.stdout)}")
    except EngineError as e:
        say("error", str(e))
    report.accounting = sacct(["1"]) is not None
    return report


class Slurm(Engine):
    """One job array a submission; `options`: fleet.toml's [slurm] as the login node needs it
    (job_name, sbatch options, max_parallel, partition, account)."""
    key = "slurm"
    label = "Slurm"

    def __init__(self, options: dict):
        self.options = options

    def views_of(self, jobs: list[str]) -> dict[str, View]:
        return views_of(jobs)

    def start(self, run_dir: str, spec: dict, launches: dict[str, int],
              submission: str) -> tuple[dict[str, str], str | None, str | None]:
        argv = ["sbatch", "--parsable", f"--job-name={spec['job_name']}",
                f"--array={array_spec([int(k) for k in launches], spec.get('max_parallel'))}",
                f"--output={os.path.join(run_dir, 'shards', '%a', protocol.LOG_FILE)}",
                "--open-mode=append", "--no-requeue", *spec.get("sbatch", []),
                task_script(run_dir), spec["pythonpath"], spec["python"], submission]
        r = _run(argv)
        if r.returncode != 0:
            return {}, f"sbatch refused: {last_line(r.stderr or r.stdout)}", shlex.join(argv)
        job = r.stdout.strip().split(";")[0].strip()
        if not job.isdigit():
            return {}, f"sbatch printed no job id: {last_line(r.stdout)}", shlex.join(argv)
        return {k: f"{job}_{k}" for k in launches}, None, shlex.join(argv)

    def end(self, jobs: list[str], job_name: str | None = None) -> str | None:
        return _scancel(jobs, [f"--name={job_name}", f"--user={getpass.getuser()}"] if job_name else None)

    def check(self, args: argparse.Namespace) -> protocol.EngineCheck:
        return check(self.options.get("partition"), self.options.get("account"), args.shards)

    def task_place(self, index: str | None) -> TaskPlace:
        index = index or os.environ.get("SLURM_ARRAY_TASK_ID", "")
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
        job = f"{os.environ.get('SLURM_ARRAY_JOB_ID', os.environ.get('SLURM_JOB_ID', '?'))}_{index}"
        return TaskPlace(index, node, job, allocated_gpus())


def make(options: dict) -> Slurm:
    return Slurm(options)


if __name__ == "__main__":
    sys.exit(tasks_main("slurm", make))


