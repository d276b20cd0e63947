"""Starting and stopping shard processes on a host, so they outlive the SSH connection.

    python -m worker.hostctl launch --shard-dir D --attempt N --by auto [--env K=V] [--cwd DIR] -- ARGV...
    python -m worker.hostctl stop --shard-dir D [--timeout 10]

`launch` takes an exclusive flock on D/lock and hands it to a detached runner (new session, all
streams redirected), which hands it on to the shard process: the lock is held while either lives,
so a second launch of a live shard is refused ("never twice"). The runner waits for the process
and appends an `exited` event with its exit code the moment it ends. Everything arrives as an argv:
no shell ever sees a value from fleet.toml. Standard library only.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

from . import protocol


def _paths(shard_dir: str) -> dict[str, str]:
    return {name: os.path.join(shard_dir, f) for name, f in
            (("lock", protocol.LOCK_FILE), ("pid", protocol.PID_FILE), ("log", protocol.LOG_FILE),
             ("events", protocol.EVENTS_FILE))}


def _try_lock(fd: int, kind: int, tries: int = 10) -> bool:
    for _ in range(tries):
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.05)            # an agent may hold a shared lock for an instant
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


def read_pid(shard_dir: str) -> int | None:
    try:
        return int(open(_paths(shard_dir)["pid"]).read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def launch(shard_dir: str, argv: list[str], env: dict[str, str], cwd: str | None,
           attempt: int, by: str, gpu: int | None = None) -> dict:
    os.makedirs(shard_dir, mode=0o755, exist_ok=True)
    p = _paths(shard_dir)
    fd = os.open(p["lock"], os.O_RDWR | os.O_CREAT, 0o644)
    if not _try_lock(fd, fcntl.LOCK_EX):
        os.close(fd)
        return {"status": "running", "pid": read_pid(shard_dir)}
    protocol.append_jsonl(p["events"], protocol.make_event(protocol.LAUNCH, attempt=attempt, by=by,
                                                           gpu=gpu, argv=argv))
    log = os.open(p["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    runner = subprocess.Popen(
        [sys.executable, "-m", "worker.hostctl", "run", "--shard-dir", shard_dir,
         "--lock-fd", str(fd), *(["--cwd", cwd] if cwd else []), "--", *argv],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, pass_fds=(fd,),
        start_new_session=True, env={**os.environ, **env})
    os.close(log)
    os.close(fd)
    return {"status": "started", "runner_pid": runner.pid}


def run(shard_dir: str, lock_fd: int, argv: list[str], cwd: str | None) -> int:
    """The detached runner: start the process, record its pid, wait, record how it ended."""
    p = _paths(shard_dir)
    stopping = []

    def forward(signum, frame):
        stopping.append(signum)
        if child is not None:
            try:
                child.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    child = None
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    log = os.open(p["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                 pass_fds=(lock_fd,), cwd=cwd)
    except OSError as e:
        protocol.append_jsonl(p["events"], protocol.make_event(
            protocol.FAILED, reason=f"cannot start {argv[0]}: {e.strerror}", exit_code=127))
        protocol.append_jsonl(p["events"], protocol.make_event(protocol.EXITED, code=127, stopped=False))
        return 127
    finally:
        os.close(log)
    with open(p["pid"] + ".tmp", "w") as f:
        f.write(f"{child.pid}\n")
    os.replace(p["pid"] + ".tmp", p["pid"])
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:
            continue
    protocol.append_jsonl(p["events"], protocol.make_event(
        protocol.EXITED, code=code, pid=child.pid, stopped=bool(stopping)))
    try:
        os.unlink(p["pid"])
    except OSError:
        pass
    return 0


def stop(shard_dir: str, timeout: float) -> dict:
    """SIGTERM the shard's process group, SIGKILL it after `timeout` s; returns once unlocked."""
    pid = read_pid(shard_dir)
    if not is_running(shard_dir) or pid is None:
        return {"status": "not running"}
    try:
        pgid = os.getpgid(pid)
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return {"status": "not running"}
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not is_running(shard_dir):
            return {"status": "stopped", "pid": pid}
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while is_running(shard_dir) and time.time() < deadline + 5:
        time.sleep(0.1)
    return {"status": "killed", "pid": pid}


def stop_all(run_dir: str, timeout: float) -> dict:
    folder = os.path.join(run_dir, "shards")
    shards = sorted(n for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []
    return {k: stop(os.path.join(folder, k), timeout)["status"] for k in shards}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.hostctl")
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("launch")
    la.add_argument("--shard-dir", required=True)
    la.add_argument("--attempt", type=int, default=0)
    la.add_argument("--by", default="manual")
    la.add_argument("--env", action="append", default=[])
    la.add_argument("--cwd", default=None)
    la.add_argument("--gpu", type=int, default=None)
    la.add_argument("argv", nargs=argparse.REMAINDER)
    ru = sub.add_parser("run")
    ru.add_argument("--shard-dir", required=True)
    ru.add_argument("--lock-fd", type=int, required=True)
    ru.add_argument("--cwd", default=None)
    ru.add_argument("argv", nargs=argparse.REMAINDER)
    st = sub.add_parser("stop")
    st.add_argument("--shard-dir", required=True)
    st.add_argument("--timeout", type=float, default=10.0)
    sa = sub.add_parser("stop-all")
    sa.add_argument("--run-dir", required=True)
    sa.add_argument("--timeout", type=float, default=10.0)
    args = ap.parse_args(argv)
    os.umask(os.umask(0o022) | 0o022)          # state files never world- or group-writable
    command = [a for a in getattr(args, "argv", [])]
    if command and command[0] == "--":
        command = command[1:]
    if args.cmd == "launch":
        if not command:
            ap.error("launch needs a command after --")
        env = dict(kv.split("=", 1) for kv in args.env)
        result = launch(args.shard_dir, command, env, args.cwd, args.attempt, args.by, args.gpu)
    elif args.cmd == "run":
        return run(args.shard_dir, args.lock_fd, command, args.cwd)
    elif args.cmd == "stop-all":
        result = stop_all(args.run_dir, args.timeout)
    else:
        result = stop(args.shard_dir, args.timeout)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
