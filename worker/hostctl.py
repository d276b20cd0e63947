"""Starting and stopping shard processes on a host, so they outlive the SSH connection.

    python -m worker.hostctl launch --shard-dir D --by auto|manual [--gpu G] [--env K=V] [--cwd DIR]
                                    [--sentinels JSON] -- ARGV...
    python -m worker.hostctl act --run-dir R [--wait S]   < JSON lines of protocol.ShardAction
    python -m worker.hostctl stop-all --run-dir R [--timeout 10]
    python -m worker.hostctl task --engine E --submission FILE [--index K]   (inside an engine's task)

`launch` takes an exclusive flock on D/lock, appends the `launch` event (numbered: 1, 2, ...) and
hands the lock to a detached runner (new session, all streams redirected), which hands it on to the
shard process: the lock is held while either lives, so a second launch of a live shard is refused
("never twice"). The runner starts the process in a process group of its own, reads a [job]'s log
for its sentinels as lines appear, and appends `exited` with the exit code the moment the process
ends, before the lock goes.

`act` is the one door for every stop and restart (the policy's, the TUI's keys, `fleet restart`,
`fleet down`): it records the intent (`stop`, with why and whether a launch follows) in the shard's
record first, then a detached finisher holding the shard's act lock signals only the process's
group (the runner survives to record the exit), escalates to SIGKILL after the grace, confirms the
group and every holder of the shard's lock are gone, and only then launches again if the intent was
a restart and no later stop cancelled it. The intent in the record is what a second supervisor sees:
it never acts twice. A host's launches arrive as one `act` command. Everything arrives as an argv
or typed JSON on stdin: no shell ever sees a value from fleet.toml. Standard library only.

`task` is the same runner inside an engine's task (worker/engine/ submitted it): it takes the
shard's lock, finds its launch in the submission file, adds the node, job and GPUs to `started`,
reports its own GPUs into the shard's folder, and runs the shard exactly as `run` does.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from . import protocol, ranged
from .files import write_atomic
from .launches import LaunchState
from .leases import LedgerError
from .sentinels import LogWatcher, SentinelSpec, log_size
from .text import exit_words

RUNNER_PID_FILE = "runner.pid"
POLL_S = 0.25


def _paths(shard_dir: str) -> dict[str, str]:
    return {name: os.path.join(shard_dir, f) for name, f in
            (("lock", protocol.LOCK_FILE), ("pid", protocol.PID_FILE), ("log", protocol.LOG_FILE),
             ("events", protocol.EVENTS_FILE), ("runner", RUNNER_PID_FILE))}


def try_lock(fd: int, kind: int, tries: int = 10) -> bool:
    for _ in range(tries):
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.05)            # an agent may hold the lock for an instant
    return False


def is_running(shard_dir: str) -> bool:
    """True while the shard's lock is held (by its runner or its process)."""
    return _held(_paths(shard_dir)["lock"])


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_pid(shard_dir: str) -> int | None:
    return _read_int(_paths(shard_dir)["pid"])


def _write_int(path: str, value: int) -> None:
    write_atomic(path, f"{value}\n")


def launch(shard_dir: str, spec: protocol.LaunchSpec, by: str) -> dict:
    """Start a shard's attempt as `spec` says, detached (`hostctl run`), unless it is running."""
    argv, sentinels, rows = spec.argv, spec.sentinels, spec.rows
    os.makedirs(shard_dir, mode=0o755, exist_ok=True)
    p = _paths(shard_dir)
    fd = os.open(p["lock"], os.O_RDWR | os.O_CREAT, 0o644)
    if not try_lock(fd, fcntl.LOCK_EX):
        os.close(fd)
        return {"status": "running", "pid": read_pid(shard_dir)}
    n = LaunchState.read(p["events"]).n + 1
    _log_marker(p["log"], f"launch {n} ({'automatic restart' if by == 'auto' else 'started by the user'})")
    offset = log_size(p["log"])                # the job's sentinels are read from here: not the marker
    protocol.append_jsonl(p["events"], protocol.Launch(launch=n, by=by, gpu=spec.gpu, argv=argv))
    log = os.open(p["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    runner = subprocess.Popen(
        [sys.executable, "-m", "worker.hostctl", "run", "--shard-dir", shard_dir,
         "--lock-fd", str(fd), "--launch", str(n), "--log-offset", str(offset),
         *(["--cwd", spec.cwd] if spec.cwd else []),
         *(["--sentinels", sentinels.to_json()] if sentinels else []),
         *(["--rows", rows.to_json()] if rows else []), "--", *argv],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=(fd,),
        start_new_session=True, env={**os.environ, **spec.env, protocol.LAUNCH_ENV: str(n),
                                     SHARD_ENV: os.path.abspath(shard_dir)})
    _write_int(p["runner"], runner.pid)
    os.close(log)
    os.close(fd)
    return {"status": "started", "launch": n, "runner_pid": runner.pid}


MARKER = "── fleet:"                         # lines the runner writes into a shard's log


def _reap_leftovers(shard_dir: str, pgid: int) -> int:
    """The shard's process has ended: whatever it left (its process group, and forks that left the
    group but hold the shard's lock) is killed, so no process outlives its launch — a DONE shard
    holds no GPU and a stop means stopped. Returns how many there were."""
    found = 0
    if _group_alive(pgid):
        found += 1
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + 2.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in shard_processes(shard_dir):
        if pid != os.getpid():
            found += 1
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return found


def _log_marker(path: str, text: str) -> None:
    """One line in the shard's log saying where an attempt begins or how it ended (the log view
    would otherwise run attempts together)."""
    try:
        with open(path, "ab+") as f:
            size = f.seek(0, os.SEEK_END)
            if size:
                f.seek(size - 1)
            fresh_line = size == 0 or f.read(1) == b"\n"
            f.write(("" if fresh_line else "\n").encode()
                    + f"{MARKER} {time.strftime('%Y-%m-%d %H:%M:%S')} {text} ──\n".encode())
    except OSError:
        pass


def run(shard_dir: str, lock_fd: int, argv: list[str], cwd: str | None, launch_n: int,
        log_offset: int, sentinels: SentinelSpec | None, started: dict | None = None,
        rows: protocol.RowShare | None = None) -> int:
    """The detached runner: start the process, record its pid, follow its log for sentinels,
    record how it ended. `started`: more fields for the `started` event (an engine task's node).
    `rows`: a [job] that takes its rows, run once per chunk of its leases (worker/ranged.py)."""
    p = _paths(shard_dir)
    stopping: list[int] = []
    children: list[subprocess.Popen] = []
    _forward_stops(stopping, children)

    def append(ev: protocol.Record) -> None:
        protocol.append_jsonl(p["events"], ev)

    if rows is not None:
        return _run_rows(shard_dir, lock_fd, argv, cwd, launch_n, sentinels, rows, append, stopping, children,
                         started)
    child = _start(argv, p["log"], lock_fd, cwd)
    if isinstance(child, OSError):
        append(protocol.Failed(launch=launch_n, reason=f"cannot start {argv[0]}: {child.strerror}",
                               exit_code=127))
        append(protocol.Exited(launch=launch_n, code=127))
        return 127
    children.append(child)
    _write_int(p["pid"], child.pid)
    append(protocol.Started(launch=launch_n, pid=child.pid, **(started or {})))
    watcher = LogWatcher(sentinels, p["log"], log_offset, launch_n,
                         _shard_number(shard_dir)) if sentinels else None
    code = _wait(child, watcher, append)
    leftovers = _reap_leftovers(shard_dir, child.pid)
    append(protocol.Exited(launch=launch_n, code=code, pid=child.pid, stopped=bool(stopping)))
    if leftovers:
        _log_marker(p["log"], f"launch {launch_n}: {leftovers} process(es) it left behind were killed")
    return _ended(p, launch_n, code)


def _ended(p: dict[str, str], launch_n: int, code: int) -> int:
    """The launch's last log line; its pid files go."""
    _log_marker(p["log"], f"launch {launch_n} {exit_words(code)}{_stop_words(p['events'], launch_n)}")
    for path in (p["pid"], p["runner"]):
        try:
            os.unlink(path)
        except OSError:
            pass
    return 0


def _run_rows(shard_dir: str, lock_fd: int, argv: list[str], cwd: str | None, launch_n: int,
              sentinels: SentinelSpec | None, rows: protocol.RowShare, append, stopping: list[int],
              children: list[subprocess.Popen], started: dict | None) -> int:
    """A [job] that takes its rows: the command once per chunk of the leases it holds
    (worker/ranged.py), each chunk's log read for its sentinels, each chunk's leftovers killed."""
    p = _paths(shard_dir)
    spec = sentinels or SentinelSpec()

    def record_and_say(ev: protocol.Record) -> None:
        append(ev)
        if isinstance(ev, protocol.Leased):           # the log says where the next chunks come from
            source = {"dead": f" (taken over from shard {ev.from_shard})", "stolen": f" (stolen from shard {ev.from_shard})",
                      "adopted": f" (of lost host {ev.from_host})", "freed": " (freed)"}.get(ev.how, "")
            _log_marker(p["log"], f"launch {launch_n}: leased rows {ev.start:,}–{ev.stop:,}{source}")
        elif isinstance(ev, protocol.LeaseMoved):
            _log_marker(p["log"], f"launch {launch_n}: gave rows {ev.start:,}–{ev.stop:,} to shard {ev.to_shard}")

    def run_chunk(chunk_argv: list[str], a: int, b: int, translate, alive_fd: int) -> ranged.Chunk:
        _log_marker(p["log"], f"launch {launch_n}: rows {a:,}–{b:,}")
        offset = log_size(p["log"])
        child = _start(chunk_argv, p["log"], lock_fd, cwd, alive_fd)
        if isinstance(child, OSError):
            append(protocol.Failed(launch=launch_n, reason=f"cannot start {chunk_argv[0]}: {child.strerror}",
                                   exit_code=127))
            return ranged.Chunk(127, False, False)
        children[:] = [child]
        _write_int(p["pid"], child.pid)
        seen = {"done": False, "fail": False}

        def record(ev: protocol.Record) -> None:
            if isinstance(ev, protocol.Sentinel):
                seen[ev.match] = True
            out = translate(ev)
            if out is not None:
                append(out)
        watcher = LogWatcher(spec, p["log"], offset, launch_n, _shard_number(shard_dir)) if sentinels else None
        code = _wait(child, watcher, record)
        if leftovers := _reap_leftovers(shard_dir, child.pid):
            _log_marker(p["log"], f"launch {launch_n}: {leftovers} process(es) it left behind were killed")
        return ranged.Chunk(code, seen["done"], seen["fail"])

    try:
        code = ranged.run_rows(rows, shard_dir, launch_n, argv, run_chunk, record_and_say, lambda: bool(stopping),
                               needs_done_line=spec.done is not None, started=started)
    except LedgerError as e:                     # the pool's ledger says what cannot be: a restart reads the same
        append(protocol.Failed(launch=launch_n, reason=str(e), fatal=True))
        code = 1
    except (OSError, ValueError) as e:           # the pool's ledger unusable: said, and the launch fails
        append(protocol.Failed(launch=launch_n, reason=f"leases in {os.path.dirname(os.path.dirname(shard_dir))}: "
                                                       f"{type(e).__name__}: {e}"))
        code = 1
    append(protocol.Exited(launch=launch_n, code=code, pid=os.getpid(), stopped=bool(stopping)))
    return _ended(p, launch_n, code)


def _forward_stops(stopping: list[int], children: list[subprocess.Popen]) -> None:
    """SIGTERM, SIGINT or SIGHUP to the runner is noted in `stopping` (the launch ended by a stop)
    and passed on as SIGTERM to the process group of the child, once there is one: the runner
    itself lives on to record the exit."""
    def forward(signum, frame):
        stopping.append(signum)
        for child in children:
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)


_prctl: Callable[..., int] | None = None   # inside an engine's task: libc's prctl (the shard dies with its runner)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the runner dies (PR_SET_PDEATHSIG). An engine's task
    can lose its runner with no chance to end the shard (a lost node, the engine's kill); the shard's
    process must not write on alone, unseen. Nothing is imported here: between fork and exec an
    import can wait forever on a lock another thread of the runner held at the fork."""
    assert _prctl is not None             # (_start runs this only once it is set)
    _prctl(1, signal.SIGKILL)


def _start(argv: list[str], log_path: str, lock_fd: int, cwd: str | None,
           alive_fd: int | None = None) -> subprocess.Popen | OSError:
    """The shard's process in a session (and process group) of its own, its output appended to the
    log, holding the shard's lock (and, for a [job] taking its rows, its pool member's alive lock);
    a command that cannot start is returned as its OSError (the launch fails with it) while a log
    that cannot be opened raises."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                pass_fds=(lock_fd,) if alive_fd is None else (lock_fd, alive_fd), cwd=cwd,
                                start_new_session=True,
                                preexec_fn=_die_with_parent if _prctl is not None else None)
    except OSError as e:
        return e
    finally:
        os.close(log)


def _wait(child: subprocess.Popen, watcher: LogWatcher | None, append) -> int:
    """The child's exit code; with sentinels, its log read every POLL_S meanwhile and once more at
    the end, each event appended as it is found."""
    exited = ExitWatch(child)
    try:
        code = None
        while code is None:
            try:
                code = exited.within(POLL_S if watcher else None)
            except InterruptedError:
                continue
            if watcher:
                for ev in watcher.poll(final=code is not None):
                    append(ev)
        return code
    finally:
        exited.close()


class ExitWatch:
    """Waits for a child's exit, or a timeout, asleep: on a pidfd where the kernel has them (one
    wake-up a timeout), else by Popen.wait, whose timeout polls waitpid up to 20 times a second —
    a runner of a silent [job] spent 0.3% of a core on that (512 of them, in bench/join.py, one
    and a half cores)."""

    def __init__(self, child: subprocess.Popen):
        self.child = child
        try:
            self.fd: int | None = os.pidfd_open(child.pid)
        except (AttributeError, OSError):        # (no pidfd: Linux before 5.3, another system)
            self.fd = None

    def within(self, timeout: float | None) -> int | None:
        """The exit code, or None if the child still runs after `timeout` s (None: until it exits)."""
        if self.fd is not None and timeout is not None:
            readable, _, _ = select.select([self.fd], [], [], timeout)
            return self.child.wait() if readable else None
        try:
            return self.child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _stop_words(events: str, launch_n: int) -> str:
    """What the launch's log marker adds where a stop was asked of it: " after a restart stop (why)"."""
    intent = LaunchState.read(events).stop_of(launch_n)
    if not intent:
        return ""
    return f" after a {intent.why} stop" + (f" ({intent.reason})" if intent.reason else "")


GPU_REPORT_S = 2.0             # how often an engine's task rewrites its GPU reading


def _report_gpus(path: str, launch_n: int, node: str, allocated: list[int] | None,
                 stop: threading.Event) -> None:
    """An engine task's own GPUs (NVML inside its allocation), rewritten into the shard's folder
    for the agent on the login node; never raises (telemetry must not take a shard down)."""
    from .engine.tasks import own_gpus
    from .gpu import GpuReader
    try:
        reader = GpuReader()
    except Exception:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    while True:
        try:
            gpus = own_gpus(reader.read(), allocated, visible)
            reading = protocol.TaskGpus(launch=launch_n, node=node, source=reader.source, gpus=gpus,
                                        error=reader.error)
            write_atomic(path, reading.to_json())
        except Exception:
            pass
        if reader.source == "none" or stop.wait(GPU_REPORT_S):
            return


def task(submission_path: str, engine_name: str, index: str | None = None) -> int:
    """Inside an engine's task: run its shard of the submission as `run` does (which shard, node and
    GPUs: the engine says, worker/engine/). Its launch was written at submission; a task whose
    launch is no longer the shard's newest (it was resubmitted meanwhile) or already ended
    (cancelled) runs nothing."""
    from .engine import load
    place = load(engine_name).task_place(index)
    index = place.index
    with open(submission_path) as f:
        submission = json.load(f)
    entry = submission["tasks"].get(index)
    if entry is None:
        print(f"fleet: task {index!r} is not in {submission_path}", file=sys.stderr)
        return 2
    spec = protocol.LaunchSpec.from_dict(entry)
    shard_dir = protocol.shard_dir(submission["run_dir"], int(index))
    p = _paths(shard_dir)
    n = int(entry["launch"])
    fd = os.open(p["lock"], os.O_RDWR | os.O_CREAT, 0o644)
    if not try_lock(fd, fcntl.LOCK_EX, tries=600):         # 30 s: an earlier task may still be ending
        protocol.append_jsonl(p["events"], protocol.Failed(
            launch=n, reason="the shard's lock is held by another process (an earlier task still running?)"))
        protocol.append_jsonl(p["events"], protocol.Exited(launch=n))
        return 1
    state = LaunchState.read(p["events"])
    if state.n != n or state.ended:
        print(f"fleet: launch {n} of shard {index} is not live (newest {state.n}, ended {state.ended}): "
              f"nothing to run", file=sys.stderr)
        return 0
    os.environ.update(spec.env)
    global _prctl
    import ctypes
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
    os.environ[protocol.LAUNCH_ENV] = str(n)
    os.environ[SHARD_ENV] = os.path.abspath(shard_dir)
    _write_int(p["runner"], os.getpid())
    stop = threading.Event()
    reporter = threading.Thread(target=_report_gpus, daemon=True,
                                args=(os.path.join(shard_dir, protocol.GPUS_FILE), n, place.node, place.gpus, stop))
    reporter.start()
    try:
        return run(shard_dir, fd, list(spec.argv), spec.cwd, n, log_size(p["log"]),
                   spec.sentinels, started={"node": place.node, "job": place.job, "gpus": place.gpus},
                   rows=spec.rows)
    finally:
        stop.set()


def _shard_number(shard_dir: str) -> int:
    name = os.path.basename(os.path.normpath(shard_dir))
    return int(name) if name.isdigit() else 0


def _signal_group(pid: int | None, sig: int) -> bool:
    if pid is None:
        return False
    try:
        os.killpg(os.getpgid(pid), sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _group_alive(pgid: int | None) -> bool:
    if pgid is None:
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _pgid(pid: int | None) -> int | None:
    try:
        return os.getpgid(pid) if pid else None
    except ProcessLookupError:
        return None


SHARD_ENV = "FLEET_SHARD_DIR"     # set for a launch's runner and process: every fork inherits it


def shard_processes(shard_dir: str) -> list[int]:
    """Pids of every process of the shard's launches: the runner, the process, and any fork of it,
    even one that left its process group and closed its files (a double-forked daemon), found by
    the environment they inherit. What must be gone before the shard counts as stopped. Linux
    /proc; elsewhere nothing is found and the process group alone is relied on."""
    mark = f"{SHARD_ENV}={os.path.abspath(shard_dir)}".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _own(shard_dir: str, *pids: int | None) -> list[int | None]:
    """Each of `pids` (read from the shard's files) while it is still one of the shard's processes,
    else None: a pid file outlives its process, and its number, reused, may be any process on the
    host — a stale one signalled would stop a stranger's whole process group (it did: a test
    process, killed by a stop of a shard long ended). Without /proc the recorded pids are trusted."""
    if not os.path.isdir("/proc"):
        return list(pids)
    mine = set(shard_processes(shard_dir))            # (one scan of /proc for all of them)
    return [pid if pid in mine else None for pid in pids]


def _gone(shard_dir: str, pgid: int | None) -> bool:
    return not is_running(shard_dir) and not _group_alive(pgid) and not shard_processes(shard_dir)


def _wait_gone(shard_dir: str, pgid: int | None, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _gone(shard_dir, pgid):
            return True
        time.sleep(0.05)
    return _gone(shard_dir, pgid)


def kill_shard(shard_dir: str, grace: float) -> str:
    """SIGTERM the shard process's group, SIGKILL it after `grace` s, then every process still
    holding the shard's lock (a fork that left the group; last the runner, whose end the agent then
    records), until the lock is free and the group is gone. 'stopped' (it ended within the grace),
    'killed', or 'not running'."""
    p = _paths(shard_dir)
    pid, runner = _own(shard_dir, read_pid(shard_dir), _read_int(p["runner"]))
    pgid = _pgid(pid)
    if not is_running(shard_dir) and not _group_alive(pgid):
        return "not running"
    if not _signal_group(pid, signal.SIGTERM):
        _signal_group(runner, signal.SIGTERM)      # not started yet: the runner forwards it
    if _wait_gone(shard_dir, pgid, grace):
        return "stopped"
    pgid = pgid or _pgid(_own(shard_dir, read_pid(shard_dir))[0])
    for _ in range(20):
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if _wait_gone(shard_dir, pgid, 2):
            return "killed"
        holders = [h for h in shard_processes(shard_dir) if h != runner] or shard_processes(shard_dir)
        for h in holders:
            try:
                os.kill(h, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return "killed" if _wait_gone(shard_dir, pgid, 2) else "still running"


def is_acting(shard_dir: str) -> bool:
    """True while a stop or restart of the shard is being carried out (its act lock is held)."""
    return _held(os.path.join(shard_dir, protocol.ACT_LOCK_FILE))


def _held(path: str) -> bool:
    """Someone holds an flock on `path` (tried shared, without waiting, and let go at once)."""
    if not os.path.exists(path):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _launch_for(a: protocol.ShardAction, shard_dir: str) -> dict:
    """`launch` of the action's LaunchSpec."""
    spec = a.launch_spec
    if spec is None or not spec.argv:
        raise ValueError(f"shard {a.shard}: a {a.kind} needs the shard's command")
    return launch(shard_dir, spec, a.by)


def act(run_dir: str, action: protocol.ShardAction) -> protocol.ActResult:
    """Carry out one action on one shard; the one door every stop and restart goes through.

    A launch or restart is carried out only if the shard's newest launch is still the one the caller
    judged (`expect_launch`); a restart only if no other stop or restart is under way. The intent is
    recorded first (`stop`, with why and what follows), then the process group is signalled and
    escalated by a detached finisher that holds the shard's act lock until the group is gone and,
    for a restart whose intent still stands, the shard is launched again. A stop is never refused:
    written while a restart is under way, it cancels the restart's launch (and the finisher kills a
    launch that slipped in first)."""
    d = protocol.shard_dir(run_dir, action.shard)
    os.makedirs(d, mode=0o755, exist_ok=True)
    events = _paths(d)["events"]
    record = LaunchState.read(events)
    newest = record.n

    def result(status: str, detail: str | None = None) -> protocol.ActResult:
        return protocol.ActResult(shard=action.shard, status=status, launch=LaunchState.read(events).n or None,
                                  detail=detail)
    if action.kind != "stop" and action.expect_launch is not None and newest != action.expect_launch:
        return result("stale", f"launch {newest} is newer than the {action.expect_launch} acted on")
    if action.kind != "stop" and action.policy and record.user_stopped:
        return result("stale", "stopped by the user: only the user starts it again")
    fd = os.open(os.path.join(d, protocol.ACT_LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if not try_lock(fd, fcntl.LOCK_EX, tries=1):
            if action.kind != "stop":
                return result("busy", "a stop or restart of this shard is under way")
            _record_intent(events, newest, action)
            _spawn_finisher(run_dir, action, None)      # waits for the act lock, kills what is left
            return result("stopping")
        if action.kind == "launch":
            return result(_launch_for(action, d)["status"])
        running = is_running(d)
        _record_intent(events, newest, action)
        if not running:
            if action.kind == "restart":
                return result(_launch_for(action, d)["status"])
            return result("not running")          # recorded all the same: it is not restarted
        _spawn_finisher(run_dir, action, fd)
        return result("restarting" if action.kind == "restart" else "stopping")
    finally:
        os.close(fd)


def _record_intent(events: str, newest: int, action: protocol.ShardAction) -> None:
    protocol.append_jsonl(events, protocol.StopRequested(
        launch=newest or None, why=action.why, reason=action.reason, grace=action.grace,
        then="launch" if action.kind == "restart" else None,
        by=action.by if action.kind == "restart" else None))


def _spawn_finisher(run_dir: str, action: protocol.ShardAction, lock_fd: int | None) -> None:
    """A detached process (new session) that finishes the action: it outlives the SSH command."""
    args = [sys.executable, "-m", "worker.hostctl", "finish", "--run-dir", run_dir,
            "--action", action.to_json()]
    if lock_fd is not None:
        args += ["--lock-fd", str(lock_fd)]
    subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     pass_fds=(lock_fd,) if lock_fd is not None else (), start_new_session=True)


FINISH_WAIT_S = 600.0


def finish(run_dir: str, action: protocol.ShardAction, lock_fd: int | None) -> int:
    """The finisher: holding the act lock, kill the shard's processes; for a restart whose intent
    is still the newest (no stop came after it), launch again; for a stop, a launch that slipped in
    meanwhile is stopped too. Writes what it did to the shard's act.result."""
    d = protocol.shard_dir(run_dir, action.shard)
    events = _paths(d)["events"]
    if lock_fd is None:
        lock_fd = os.open(os.path.join(d, protocol.ACT_LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        if not try_lock(lock_fd, fcntl.LOCK_EX, tries=int(FINISH_WAIT_S / 0.05)):
            return 1
    status = kill_shard(d, action.grace)
    if action.kind == "restart":
        intent = LaunchState.read(events).last_stop
        if intent is not None and intent.restart and status != "still running":
            status = _launch_for(action, d)["status"]
        else:
            status = f"{status}; restart cancelled by a later stop"
    else:
        while is_running(d):                   # a restart launched just before this stop was read
            protocol.append_jsonl(events, protocol.StopRequested(
                launch=LaunchState.read(events).n or None, why=action.why, grace=action.grace))
            status = kill_shard(d, action.grace)
            if status == "still running":
                break
    _write_result(d, action, status)
    return 0


def _write_result(shard_dir: str, action: protocol.ShardAction, status: str) -> None:
    write_atomic(os.path.join(shard_dir, "act.result"),
                 json.dumps({"t": protocol.now(), "kind": action.kind, "status": status}))


def wait_idle(shard_dir: str, seconds: float) -> str | None:
    """Wait until no action is under way on the shard; the finisher's last word, if any."""
    deadline = time.monotonic() + seconds
    while is_acting(shard_dir) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        with open(os.path.join(shard_dir, "act.result")) as f:
            return json.load(f).get("status")
    except (OSError, ValueError):
        return None


def reopen(shard_dir: str, samples: int, reason: str) -> protocol.Status:
    """Record that samples of a finished shard were dropped (by verify --repair): it is not DONE."""
    if is_running(shard_dir):
        return protocol.Status("running")
    os.makedirs(shard_dir, exist_ok=True)
    protocol.append_jsonl(_paths(shard_dir)["events"], protocol.Reopened(samples=samples, reason=reason))
    return protocol.Status("reopened")


def stop_all(run_dir: str, timeout: float) -> dict:
    """`fleet down`: a run stop for every shard folder (a shard waiting for a restart is STOPPED
    too), carried out in parallel; returns once each is done: stopped / killed / not running."""
    folder = os.path.join(run_dir, "shards")
    shards = sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []
    first = {k: act(run_dir, protocol.ShardAction(shard=k, kind="stop", why="run", grace=timeout)).status
             for k in shards}
    out = {}
    for k in shards:
        last = wait_idle(protocol.shard_dir(run_dir, k), timeout + 30) if first[k] == "stopping" else None
        out[str(k)] = last or first[k]
    return out


def main(argv: list[str] | None = None) -> int:
    """One subcommand: the runner, an engine's task and the finisher return their exit code; the others
    print their result as one JSON object (act: one a line)."""
    ap = _parser()
    args = ap.parse_args(argv)
    os.umask(os.umask(0o022) | 0o022)          # state files never world- or group-writable
    command = list(getattr(args, "argv", []))
    if command and command[0] == "--":
        command = command[1:]
    sentinels = SentinelSpec.from_dict(json.loads(args.sentinels)) if getattr(args, "sentinels", None) else None
    rows = protocol.RowShare.from_dict(json.loads(args.rows)) if getattr(args, "rows", None) else None
    result: dict | protocol.Reply
    if args.cmd == "launch":
        if not command:
            ap.error("launch needs a command after --")
        env = dict(kv.split("=", 1) for kv in args.env)
        result = launch(args.shard_dir, protocol.LaunchSpec(argv=command, env=env, cwd=args.cwd, gpu=args.gpu,
                                                           sentinels=sentinels, rows=rows), args.by)
    elif args.cmd == "run":
        return run(args.shard_dir, args.lock_fd, command, args.cwd, args.launch, args.log_offset,
                   sentinels, rows=rows)
    elif args.cmd == "task":
        return task(args.submission, args.engine, args.index)
    elif args.cmd == "stop-all":
        result = stop_all(args.run_dir, args.timeout)
    elif args.cmd == "reopen":
        result = reopen(args.shard_dir, args.samples, args.reason)
    elif args.cmd == "finish":
        return finish(args.run_dir, protocol.ShardAction.from_dict(json.loads(args.action)), args.lock_fd)
    else:
        return _act_lines(args.run_dir, args.wait, sys.stdin)
    print(result.to_json() if isinstance(result, protocol.Reply) else json.dumps(result), flush=True)
    return 0


def _act_lines(run_dir: str, wait: float, lines) -> int:
    """`act`: each action (JSON lines of protocol.ShardAction) carried out in turn; with `wait`,
    each stop or restart waited for, and its result the finisher's last word; one result a line."""
    actions = [protocol.ShardAction.from_dict(json.loads(line)) for line in lines if line.strip()]
    results = [act(run_dir, a) for a in actions]
    if wait > 0:
        for a, r in zip(actions, results):
            if r.status in ("stopping", "restarting"):
                d = protocol.shard_dir(run_dir, a.shard)
                r.status, r.detail = "done", wait_idle(d, wait)
                r.launch = LaunchState.read(_paths(d)["events"]).n or None
    for r in results:
        print(r.to_json(), flush=True)
    return 0


def _parser() -> argparse.ArgumentParser:
    """Every subcommand and its options (the module's docstring says what each is for)."""
    ap = argparse.ArgumentParser(prog="python -m worker.hostctl")
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch")
    la.add_argument("--shard-dir", required=True)
    la.add_argument("--by", choices=("manual", "auto"), default="manual")
    la.add_argument("--env", action="append", default=[])
    la.add_argument("--cwd", default=None)
    la.add_argument("--gpu", type=int, default=None)
    la.add_argument("--sentinels", default=None, help="JSON: done, fail, progress, progress_glob, total")
    la.add_argument("--rows", default=None, help="JSON protocol.RowShare: a [job] taking {start}/{end}")
    la.add_argument("argv", nargs=argparse.REMAINDER)
    ru = sub.add_parser("run")
    ru.add_argument("--shard-dir", required=True)
    ru.add_argument("--lock-fd", type=int, required=True)
    ru.add_argument("--launch", type=int, required=True)
    ru.add_argument("--log-offset", type=int, default=0)
    ru.add_argument("--cwd", default=None)
    ru.add_argument("--sentinels", default=None)
    ru.add_argument("--rows", default=None)
    ru.add_argument("argv", nargs=argparse.REMAINDER)
    ac = sub.add_parser("act", help="carry out actions (JSON lines of protocol.ShardAction on stdin)")
    ac.add_argument("--run-dir", required=True)
    ac.add_argument("--wait", type=float, default=0.0,
                    help="wait up to this many seconds for each stop or restart to be carried out")
    fi = sub.add_parser("finish", help="(internal) finish a stop or restart, detached")
    fi.add_argument("--run-dir", required=True)
    fi.add_argument("--action", required=True)
    fi.add_argument("--lock-fd", type=int, default=None)
    ro = sub.add_parser("reopen")
    ro.add_argument("--shard-dir", required=True)
    ro.add_argument("--samples", type=int, required=True)
    ro.add_argument("--reason", default="")
    sa = sub.add_parser("stop-all")
    sa.add_argument("--run-dir", required=True)
    sa.add_argument("--timeout", type=float, default=10.0)
    ta = sub.add_parser("task", help="inside an engine's task (worker/engine/ submits it)")
    ta.add_argument("--submission", required=True)
    ta.add_argument("--engine", required=True, help="the engine that runs the task (worker/engine/)")
    ta.add_argument("--index", default=None, help="the shard, where the engine does not say it itself")
    return ap


if __name__ == "__main__":
    sys.exit(main())
