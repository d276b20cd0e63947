"""Starting and stopping shard processes on a host, so they outlive the SSH connection.

    python -m worker.hostctl launch --shard-dir D --by auto|manual [--gpu G] [--env K=V] [--cwd DIR]
                                    [--sentinels JSON] -- ARGV...
    python -m worker.hostctl stop --shard-dir D [--timeout 10] [--why user|restart]
    python -m worker.hostctl stop-all --run-dir R [--timeout 10]
    python -m worker.hostctl task --submission FILE      (inside a Slurm array task)

`launch` takes an exclusive flock on D/lock, appends the `launch` event (numbered: 1, 2, ...) and
hands the lock to a detached runner (new session, all streams redirected), which hands it on to the
shard process: the lock is held while either lives, so a second launch of a live shard is refused
("never twice"). The runner starts the process in a process group of its own, reads a [job]'s log
for its sentinels as lines appear, and appends `exited` with the exit code the moment the process
ends, before the lock goes. `stop` appends `stop` first and then signals only the process's group,
so the runner survives to record the exit; even if it does not, the record says the stop was
asked for. Everything arrives as an argv: no shell ever sees a value from fleet.toml. Standard
library only.

`task` is the same runner inside a Slurm array task (worker/slurm.py submitted it): it takes the
shard's lock, finds its launch in the submission file, adds the node, job and GPUs to `started`,
reports its own GPUs into the shard's folder, and runs the shard exactly as `run` does.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from . import protocol
from .sentinels import LogWatcher, SentinelSpec, log_size

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
    path = _paths(shard_dir)["lock"]
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


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_pid(shard_dir: str) -> int | None:
    return _read_int(_paths(shard_dir)["pid"])


def _write_int(path: str, value: int) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(f"{value}\n")
    os.replace(path + ".tmp", path)


def last_launch(events_path: str) -> int:
    """The number of the newest launch in a shard's record (0: never launched)."""
    n = 0
    for ev in protocol.read_events(events_path):
        if isinstance(ev, protocol.Launch):
            n = max(n, ev.launch)
    return n


def launch(shard_dir: str, argv: list[str], env: dict[str, str], cwd: str | None, by: str,
           gpu: int | None = None, sentinels: dict | None = None) -> dict:
    os.makedirs(shard_dir, mode=0o755, exist_ok=True)
    p = _paths(shard_dir)
    fd = os.open(p["lock"], os.O_RDWR | os.O_CREAT, 0o644)
    if not try_lock(fd, fcntl.LOCK_EX):
        os.close(fd)
        return {"status": "running", "pid": read_pid(shard_dir)}
    n = last_launch(p["events"]) + 1
    offset = log_size(p["log"])
    protocol.append_jsonl(p["events"], protocol.Launch(launch=n, by=by, gpu=gpu, argv=argv))
    log = os.open(p["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    runner = subprocess.Popen(
        [sys.executable, "-m", "worker.hostctl", "run", "--shard-dir", shard_dir,
         "--lock-fd", str(fd), "--launch", str(n), "--log-offset", str(offset),
         *(["--cwd", cwd] if cwd else []),
         *(["--sentinels", json.dumps(sentinels)] if sentinels else []), "--", *argv],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=(fd,),
        start_new_session=True, env={**os.environ, **env, protocol.LAUNCH_ENV: str(n)})
    _write_int(p["runner"], runner.pid)
    os.close(log)
    os.close(fd)
    return {"status": "started", "launch": n, "runner_pid": runner.pid}


def run(shard_dir: str, lock_fd: int, argv: list[str], cwd: str | None, launch_n: int,
        log_offset: int, sentinels: dict | None, started: dict | None = None) -> int:
    """The detached runner: start the process, record its pid, follow its log for sentinels,
    record how it ended. `started`: more fields for the `started` event (a Slurm task's node)."""
    p = _paths(shard_dir)
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum, frame):
        stopping.append(signum)
        if child is not None:
            try:
                os.killpg(child.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)

    def append(ev: protocol.Record) -> None:
        protocol.append_jsonl(p["events"], ev)

    log = os.open(p["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 pass_fds=(lock_fd,), cwd=cwd, start_new_session=True)
    except OSError as e:
        append(protocol.Failed(launch=launch_n, reason=f"cannot start {argv[0]}: {e.strerror}",
                               exit_code=127))
        append(protocol.Exited(launch=launch_n, code=127))
        return 127
    finally:
        os.close(log)
    _write_int(p["pid"], child.pid)
    append(protocol.Started(launch=launch_n, pid=child.pid, **(started or {})))
    watcher = LogWatcher(SentinelSpec.from_dict(sentinels), p["log"], log_offset, launch_n,
                         _shard_number(shard_dir)) if sentinels else None
    code = None
    while code is None:
        try:
            code = child.wait(timeout=POLL_S if watcher else None)
        except subprocess.TimeoutExpired:
            pass
        except InterruptedError:
            continue
        if watcher:
            for ev in watcher.poll(final=code is not None):
                append(ev)
    append(protocol.Exited(launch=launch_n, code=code, pid=child.pid, stopped=bool(stopping)))
    for path in (p["pid"], p["runner"]):
        try:
            os.unlink(path)
        except OSError:
            pass
    return 0


GPU_REPORT_S = 2.0             # how often a Slurm task rewrites its GPU reading


def _report_gpus(path: str, launch_n: int, node: str, stop: threading.Event) -> None:
    """A Slurm task's own GPUs (NVML inside its allocation), rewritten into the shard's folder for
    the agent on the login node; never raises (telemetry must not take a shard down)."""
    from . import slurm
    from .gpu import GpuReader
    try:
        reader = GpuReader()
    except Exception:
        return
    allocated, visible = slurm.allocated_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES")
    while True:
        try:
            gpus = slurm.own_gpus(reader.read(), allocated, visible)
            slurm.write_atomic(path, json.dumps({"t": protocol.now(), "launch": launch_n, "node": node,
                                                   "source": reader.source, "gpus": gpus,
                                                   "error": reader.error}), 0o644)
        except Exception:
            pass
        if reader.source == "none" or stop.wait(GPU_REPORT_S):
            return


def task(submission_path: str) -> int:
    """Inside a Slurm array task: run shard SLURM_ARRAY_TASK_ID of the submission as `run` does.
    Its launch was written at submission; a task whose launch is no longer the shard's newest (it
    was resubmitted meanwhile) or already ended (cancelled) runs nothing."""
    from . import slurm
    index = os.environ.get("SLURM_ARRAY_TASK_ID", "")
    with open(submission_path) as f:
        submission = json.load(f)
    spec = submission["tasks"].get(index)
    if spec is None:
        print(f"fleet: array index {index!r} is not in {submission_path}", file=sys.stderr)
        return 2
    shard_dir = protocol.shard_dir(submission["run_dir"], int(index))
    p = _paths(shard_dir)
    n = int(spec["launch"])
    fd = os.open(p["lock"], os.O_RDWR | os.O_CREAT, 0o644)
    if not try_lock(fd, fcntl.LOCK_EX, tries=600):         # 30 s: an earlier task may still be ending
        protocol.append_jsonl(p["events"], protocol.Failed(
            launch=n, reason="the shard's lock is held by another process (an earlier task still running?)"))
        protocol.append_jsonl(p["events"], protocol.Exited(launch=n))
        return 1
    state = slurm.LaunchState.read(p["events"])
    if state.n != n or state.ended:
        print(f"fleet: launch {n} of shard {index} is not live (newest {state.n}, ended {state.ended}): "
              f"nothing to run", file=sys.stderr)
        return 0
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
    job = f"{os.environ.get('SLURM_ARRAY_JOB_ID', os.environ.get('SLURM_JOB_ID', '?'))}_{index}"
    os.environ.update(spec.get("env") or {})
    os.environ[protocol.LAUNCH_ENV] = str(n)
    _write_int(p["runner"], os.getpid())
    stop = threading.Event()
    reporter = threading.Thread(target=_report_gpus, daemon=True,
                                args=(os.path.join(shard_dir, protocol.GPUS_FILE), n, node, stop))
    reporter.start()
    try:
        return run(shard_dir, fd, list(spec["argv"]), spec.get("cwd"), n, log_size(p["log"]),
                   spec.get("sentinels"), started={"node": node, "job": job, "gpus": slurm.allocated_gpus()})
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


def _wait_unlocked(shard_dir: str, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if not is_running(shard_dir):
            return True
        time.sleep(0.1)
    return not is_running(shard_dir)


def stop(shard_dir: str, timeout: float, why: str = "user", reason: str | None = None) -> dict:
    """Record the stop, SIGTERM the process's group, SIGKILL it after `timeout` s (and the runner
    too if it still holds the lock); returns once the lock is free."""
    if not is_running(shard_dir):
        return {"status": "not running"}
    p = _paths(shard_dir)
    protocol.append_jsonl(p["events"], protocol.StopRequested(launch=last_launch(p["events"]) or None,
                                                              why=why, reason=reason))
    pid, runner = read_pid(shard_dir), _read_int(p["runner"])
    if not _signal_group(pid, signal.SIGTERM):
        _signal_group(runner, signal.SIGTERM)      # not started yet: the runner forwards it
    if _wait_unlocked(shard_dir, timeout):
        return {"status": "stopped", "pid": pid}
    _signal_group(read_pid(shard_dir), signal.SIGKILL)
    if not _wait_unlocked(shard_dir, 5):
        _signal_group(runner, signal.SIGKILL)      # the runner is stuck: the agent records the end
        _wait_unlocked(shard_dir, 5)
    return {"status": "killed", "pid": pid}


def reopen(shard_dir: str, samples: int, reason: str) -> dict:
    """Record that samples of a finished shard were dropped (by verify --repair): it is not DONE."""
    if is_running(shard_dir):
        return {"status": "running"}
    os.makedirs(shard_dir, exist_ok=True)
    protocol.append_jsonl(_paths(shard_dir)["events"], protocol.Reopened(samples=samples, reason=reason))
    return {"status": "reopened"}


def stop_all(run_dir: str, timeout: float) -> dict:
    folder = os.path.join(run_dir, "shards")
    shards = sorted(n for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []
    return {k: stop(os.path.join(folder, k), timeout)["status"] for k in shards}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.hostctl")
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch")
    la.add_argument("--shard-dir", required=True)
    la.add_argument("--by", choices=("manual", "auto"), default="manual")
    la.add_argument("--env", action="append", default=[])
    la.add_argument("--cwd", default=None)
    la.add_argument("--gpu", type=int, default=None)
    la.add_argument("--sentinels", default=None, help="JSON: done, fail, progress, progress_glob, total")
    la.add_argument("argv", nargs=argparse.REMAINDER)
    ru = sub.add_parser("run")
    ru.add_argument("--shard-dir", required=True)
    ru.add_argument("--lock-fd", type=int, required=True)
    ru.add_argument("--launch", type=int, required=True)
    ru.add_argument("--log-offset", type=int, default=0)
    ru.add_argument("--cwd", default=None)
    ru.add_argument("--sentinels", default=None)
    ru.add_argument("argv", nargs=argparse.REMAINDER)
    st = sub.add_parser("stop")
    st.add_argument("--shard-dir", required=True)
    st.add_argument("--timeout", type=float, default=10.0)
    st.add_argument("--why", choices=("user", "restart"), default="user")
    st.add_argument("--reason", default=None, help="for a restart: the failure it restarts from")
    ro = sub.add_parser("reopen")
    ro.add_argument("--shard-dir", required=True)
    ro.add_argument("--samples", type=int, required=True)
    ro.add_argument("--reason", default="")
    sa = sub.add_parser("stop-all")
    sa.add_argument("--run-dir", required=True)
    sa.add_argument("--timeout", type=float, default=10.0)
    ta = sub.add_parser("task", help="inside a Slurm array task (worker.slurm submits it)")
    ta.add_argument("--submission", required=True)
    args = ap.parse_args(argv)
    os.umask(os.umask(0o022) | 0o022)          # state files never world- or group-writable
    command = list(getattr(args, "argv", []))
    if command and command[0] == "--":
        command = command[1:]
    sentinels = json.loads(args.sentinels) if getattr(args, "sentinels", None) else None
    if args.cmd == "launch":
        if not command:
            ap.error("launch needs a command after --")
        env = dict(kv.split("=", 1) for kv in args.env)
        result = launch(args.shard_dir, command, env, args.cwd, args.by, args.gpu, sentinels)
    elif args.cmd == "run":
        return run(args.shard_dir, args.lock_fd, command, args.cwd, args.launch, args.log_offset,
                   sentinels)
    elif args.cmd == "task":
        return task(args.submission)
    elif args.cmd == "stop-all":
        result = stop_all(args.run_dir, args.timeout)
    elif args.cmd == "reopen":
        result = reopen(args.shard_dir, args.samples, args.reason)
    else:
        result = stop(args.shard_dir, args.timeout, args.why, args.reason)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
