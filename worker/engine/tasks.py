"""What every engine that queues shards as tasks shares, on its login node: the run's lock, a
launch recorded before the engine is asked, the engine's final word recorded once, cancelling, and
the command line (`python -m worker.engine.<name> check | submit | cancel | cancel-all`).

An `Engine` supplies only what is its own: asking about tasks (`views_of`, in neutral `View`s),
starting them (`start`), ending them (`end`), where a task runs from inside it (`task_place`), and
its checks. Everything written into a shard's record is written here, so Slurm's and Ray's records
read the same to the agent and the supervisor.

A submission writes, for every shard it covers, `launch` (numbered as hostctl numbers them,
`launcher = <engine>`) into the shard's record, then its part of the submission file (argv,
environment, sentinels, the launch number), then asks the engine. The engine's name for each task is
then recorded as `submitted`; a refusal as `failed` + `exited`, so the judge backs off and retries it
under the restart policy like any failed attempt. Inside each task `python -m worker.hostctl task`
runs the shard exactly as the SSH runner does (lock, `started`, sentinels, `exited`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass

from .. import protocol
from ..files import write_atomic
from ..launches import LaunchState

ENGINE_DIR = "engine"               # <run>/engine: submission files, the lock, an engine's scripts


class EngineError(Exception):
    """The engine did not answer (its controller down, its client missing); the message says so."""


@dataclass(frozen=True)
class View:
    """One task as the engine shows it now, in neutral words: `phase` queued | running | ending |
    ended (protocol.TASK_PHASES, and ended), `end` one of protocol.TASK_ENDS once ended; `state`
    and `reason` the engine's own words, for people."""
    job: str
    phase: str
    state: str
    reason: str | None = None
    node: str | None = None
    end: str | None = None

    @property
    def terminal(self) -> bool:
        return self.phase == "ended"

    @property
    def live(self) -> bool:
        return not self.terminal


@dataclass(frozen=True)
class TaskPlace:
    """Where a task runs, as it finds out from inside: which shard (the submission's key), the
    node, the engine's name for the task, and the node's GPU indices it was given."""
    index: str
    node: str
    job: str
    gpus: list[int] | None


class Engine:
    """One engine's own part. `key` is what a launch records as its launcher; `label` its name for
    people ("Slurm NODE_FAIL on node07")."""
    key = ""
    label = ""

    def views_of(self, jobs: list[str]) -> dict[str, View]:
        """Every one of `jobs` as the engine sees it (an ended one as ended, with how; one it no
        longer knows as ended "unknown"). Only for tasks whose `submitted` was read before the
        call: then "not listed" means gone. Raises EngineError."""
        raise NotImplementedError

    def start(self, run_dir: str, spec: dict, launches: dict[str, int],
              submission: str) -> tuple[dict[str, str], str | None, str | None]:
        """Ask the engine to run these launches (shard -> launch number; their part of the
        submission file at `submission`): (shard -> the engine's name for its task, the error if
        it refused them all, the command given, for people)."""
        raise NotImplementedError

    def end(self, jobs: list[str], job_name: str | None = None) -> str | None:
        """Ask the engine to end these tasks (and, with `job_name`, any other of the run's): the
        error, or None."""
        raise NotImplementedError

    def check(self, args: argparse.Namespace) -> protocol.EngineCheck:
        raise NotImplementedError

    def task_place(self, index: str | None) -> TaskPlace:
        """Inside a task: where it runs (`index`: the shard, when the engine passes it as an
        argument rather than in the environment)."""
        raise NotImplementedError


def events_path(shard_dir: str) -> str:
    return os.path.join(shard_dir, protocol.EVENTS_FILE)


def record_end(shard_dir: str, view: View, label: str) -> list[protocol.Record]:
    """Record the engine's final word on the newest launch's task (once), and its end if the task
    never recorded one. Re-reads the record first: the task's runner writes `exited` before its
    task ends, so what is read after a final state is everything the task will ever write."""
    path = events_path(shard_dir)
    state = LaunchState.read(path)
    if not state.n or state.job != view.job:
        return []
    written: list[protocol.Record] = []
    # Once: and after the task's own end only when the engine ended it (then it says why it failed).
    if not state.task_ended and (not state.ended or view.end in protocol.ENGINE_ENDED):
        # (a task that never ran keeps its queue reason: not why it ended)
        written.append(protocol.TaskEnded(
            launch=state.n, job=view.job, end=view.end or "unknown", state=view.state, engine=label,
            reason=view.reason if view.node or view.end == "unknown" else None, node=view.node))
    if not state.ended:
        written.append(protocol.Exited(launch=state.n, vanished=True))
    for ev in written:
        protocol.append_jsonl(path, ev)
    return written


def unknown(job: str, why: str) -> View:
    """A task the engine no longer knows: ended, how unknown."""
    return View(job, "ended", "UNKNOWN", why, end="unknown")


class RunLock:
    """`<run>/engine/lock`: one submission or cancellation of the run at a time on the login node,
    and the agent's proof that no submission is half done."""

    def __init__(self, run_dir: str):
        folder = os.path.join(run_dir, ENGINE_DIR)
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
            raise EngineError(f"another fleet command holds {self.path} for over 120s")
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def settle_unended(shard_dir: str, state: LaunchState, views: dict[str, View], label: str) -> str | None:
    """Before a new launch: the newest one must be over. Returns "queued"/"running" when the engine
    still holds its task (nothing to do), or None after recording the end of a task the engine has
    finished (or of a submission that never reached the engine)."""
    if state.ended or not state.n:
        return None
    if state.job is None:                       # the submitter died between launch and the engine
        protocol.append_jsonl(events_path(shard_dir), protocol.Failed(
            launch=state.n, reason=f"the submission never reached {label}"))
        protocol.append_jsonl(events_path(shard_dir), protocol.Exited(launch=state.n, vanished=True))
        return None
    view = views.get(state.job)
    if view is not None and view.live:
        return "queued" if view.phase == "queued" else "running"
    record_end(shard_dir, view or unknown(state.job, f"{label} no longer knows the task"), label)
    return None


# --- submitting ----------------------------------------------------------------------------------

def submit(engine: Engine, run_dir: str, spec: dict) -> protocol.Submission:
    """Submit `spec["tasks"]` (shard -> argv, env, cwd, sentinels) in one request to the engine.
    Shards whose newest launch the engine still holds are left alone ("never twice"); the others
    get a launch each."""
    by = spec.get("by", "manual")
    tasks = {k: protocol.LaunchSpec.from_dict(v, f"tasks.{k}") for k, v in spec["tasks"].items()}
    result: dict[str, str] = {}
    with RunLock(run_dir):
        states = {k: LaunchState.read(events_path(protocol.shard_dir(run_dir, int(k)))) for k in tasks}
        jobs = [s.job for s in states.values() if not s.ended and s.job]
        views = engine.views_of(jobs) if jobs else {}
        launches: dict[str, int] = {}
        for k, state in states.items():
            shard_dir = protocol.shard_dir(run_dir, int(k))
            os.makedirs(shard_dir, mode=0o755, exist_ok=True)
            held = settle_unended(shard_dir, state, views, engine.label)
            if held:
                result[k] = held
                continue
            n = LaunchState.read(events_path(shard_dir)).n + 1
            protocol.append_jsonl(events_path(shard_dir), protocol.Launch(
                launch=n, by=by, gpu=None, argv=tasks[k].argv, launcher=engine.key))
            launches[k] = n
        if not launches:
            return protocol.Submission(status="held", shards=result)
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        submission = os.path.join(run_dir, ENGINE_DIR, f"submit-{stamp}.json")
        write_atomic(submission, json.dumps({
            "run_dir": run_dir, "by": by,
            "tasks": {k: {**tasks[k].to_dict(), "launch": n} for k, n in launches.items()}}), 0o600)
        try:
            jobs_of, error, argv = engine.start(run_dir, spec, launches, submission)
        except EngineError as e:
            jobs_of, error, argv = {}, str(e), None
        for k, n in launches.items():
            path = events_path(protocol.shard_dir(run_dir, int(k)))
            if k in jobs_of:
                protocol.append_jsonl(path, protocol.Submitted(launch=n, job=jobs_of[k]))
                result[k] = "submitted"
            else:
                protocol.append_jsonl(path, protocol.Failed(launch=n, reason=error or f"{engine.label} "
                                                            "did not take the task"))
                protocol.append_jsonl(path, protocol.Exited(launch=n))
                result[k] = "refused"
        if error is not None and not jobs_of:
            return protocol.Submission(status="error", error=error, shards=result)
        job = os.path.commonprefix(sorted(jobs_of.values())).rstrip("_-") or None
        return protocol.Submission(status="submitted", job=job, argv=argv, shards=result, error=error)


# --- cancelling ------------------------------------------------------------------------------------

def _wait_final(engine: Engine, jobs: list[str], timeout: float) -> dict[str, View]:
    """Poll until every one of `jobs` is in a final state (after its ending: its task wrote what it
    will write) or `timeout` passes; the last views."""
    deadline = time.monotonic() + timeout
    while True:
        views = engine.views_of(jobs)
        if all(views[j].terminal for j in jobs) or time.monotonic() >= deadline:
            return views
        time.sleep(0.3)


def cancel(engine: Engine, run_dir: str, shard: int, why: str, reason: str | None, timeout: float,
           then: str | None = None, by: str | None = None) -> protocol.Cancellation:
    """`stop` first (the intent: the user's or the run's stop, a restart's, the policy giving up),
    then the engine ends the shard's task; returns once the engine says it is over (its end
    recorded), or "cancelling" after `timeout`. A user's stop of a shard that is not running is
    still recorded: a shard waiting to be resubmitted is STOPPED."""
    shard_dir = protocol.shard_dir(run_dir, shard)
    with RunLock(run_dir):
        state = LaunchState.read(events_path(shard_dir))
        if state.ended or not state.n:
            if why in protocol.USER_STOPS:
                os.makedirs(shard_dir, mode=0o755, exist_ok=True)
                protocol.append_jsonl(events_path(shard_dir), protocol.StopRequested(
                    launch=state.n or None, why=why, reason=reason))
            return protocol.Cancellation(status="not running")
        protocol.append_jsonl(events_path(shard_dir), protocol.StopRequested(
            launch=state.n, why=why, reason=reason, then=then, by=by))
        if state.job is None:
            settle_unended(shard_dir, state, {}, engine.label)
            return protocol.Cancellation(status="stopped")
        error = engine.end([state.job])
        if error:
            return protocol.Cancellation(status="error", error=error)
        view = _wait_final(engine, [state.job], timeout)[state.job]
        if not view.terminal:
            return protocol.Cancellation(status="cancelling", job=state.job, state=view.state)
        record_end(shard_dir, view, engine.label)
        return protocol.Cancellation(status="stopped", job=state.job, state=view.state)


def cancel_all(engine: Engine, run_dir: str, job_name: str | None, timeout: float) -> protocol.Cancellation:
    """Every live shard of the run: `stop` (the user's) in its record, then one request to end all
    their tasks, and any other task of the run's name (a submission whose tasks were never recorded)."""
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
        error = engine.end(jobs, job_name)
        if error:
            return protocol.Cancellation(status="error", error=error)
        views = _wait_final(engine, jobs, timeout) if jobs else {}
        for k, state in live.items():
            shard_dir = protocol.shard_dir(run_dir, k)
            if state.job is None:
                settle_unended(shard_dir, state, {}, engine.label)
                out[str(k)] = "stopped"
            elif views[state.job].terminal:
                record_end(shard_dir, views[state.job], engine.label)
                out[str(k)] = "stopped"
            else:
                out[str(k)] = "cancelling"
    return protocol.Cancellation(status="cancelled", shards=out)


# --- inside a task -------------------------------------------------------------------------------

def own_gpus(readings: list[protocol.GpuStat], allocated: list[int] | None,
             visible: str | None) -> list[protocol.GpuStat]:
    """The task's own GPUs among NVML's readings of its node: by index when the engine said which,
    by UUID when CUDA_VISIBLE_DEVICES holds UUIDs; all readable ones when nothing says (a node whose
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


def gpu_indices(value: str | None) -> list[int] | None:
    """"2,3" -> [2, 3]; None for nothing, or for UUIDs."""
    value = (value or "").strip()
    if not value:
        return None
    try:
        return [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        return None


# --- the command line ----------------------------------------------------------------------------

def main(name: str, make, argv: list[str] | None = None) -> int:
    """`python -m worker.engine.<name>`: one subcommand, its typed reply as one JSON line (`make`:
    the engine's module's factory, given its options)."""
    ap = argparse.ArgumentParser(prog=f"python -m worker.engine.{name}")
    ap.add_argument("--options", default="{}", help="the engine's section of fleet.toml, as JSON")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--shards", type=int, default=None)
    c.add_argument("--run-dir", default=None, help="the run's folder, which every node must see")
    c.add_argument("--output", default=None, help="the output folder, which every node must see "
                   "unless the output is shipped (--shipped)")
    c.add_argument("--shipped", action="store_true", help="[run] destination is set")
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
    engine = make(json.loads(args.options))
    os.umask(os.umask(0o022) | 0o022)
    result: protocol.Reply
    try:
        if args.cmd == "check":
            result = engine.check(args)
        elif args.cmd == "submit":
            result = submit(engine, args.run_dir, json.loads(sys.stdin.read()))
        elif args.cmd == "cancel":
            result = cancel(engine, args.run_dir, args.shard, args.why, args.reason, args.timeout, args.then,
                            args.by)
        else:
            result = cancel_all(engine, args.run_dir, args.job_name, args.timeout)
    except EngineError as e:
        result = (protocol.EngineCheck(checks=[protocol.Check("error", str(e))]) if args.cmd == "check"
                  else protocol.Submission(error=str(e)) if args.cmd == "submit"
                  else protocol.Cancellation(error=str(e)))
    print(result.to_json(), flush=True)
    return 0
