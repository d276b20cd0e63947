"""One supervisor per run, held on the run's own hosts (issue 52): the supervising agent holds
`<run dir>/supervisor.lock` (an flock, gone with the agent) and writes who it serves beside it
(`supervisor.json`, a protocol.SupervisorClaim). An agent of another supervisor finds the lock
held and says whose it is (`Claimed`); its supervisor refuses to run beside the first.

The agent lives as long as its supervisor's stream: its stdin closes with the SSH channel (or the
local pipe), and with a claim it also goes once its supervisor has said nothing on stdin for
`ttl` seconds (the supervisor writes a line every few seconds), so a supervisor whose laptop went
to sleep lets go of the run within minutes even where the channel stays half open. An agent of
the same supervisor (a reconnect), or one told to take over, ends the holder first.

Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import time

from . import protocol

WAIT_S = 10.0          # how long a new agent waits for the holder it ended to let go


def holder(run_dir: str) -> protocol.SupervisorClaim | None:
    """Who holds the run's claim, as its supervisor.json says (None: none written, or unreadable)."""
    try:
        with open(os.path.join(run_dir, protocol.CLAIM_FILE)) as f:
            return protocol.SupervisorClaim.from_dict(json.load(f))
    except (OSError, ValueError):
        return None


def _is_agent(pid: int) -> bool:
    """Whether `pid` is an agent of this worker (never signal a pid reused by something else)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"worker.agent" in f.read()
    except OSError:
        return not os.path.isdir("/proc")          # no /proc (macOS): trust the recorded pid


def take(run_dir: str, claim: protocol.SupervisorClaim, take_over: bool = False):
    """Hold the run's claim for this process: the lock's fd, or the holder's claim when another
    supervisor holds it. The holder is ended first when it is this supervisor's own earlier agent
    or when told to take over."""
    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(os.path.join(run_dir, protocol.CLAIM_LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + WAIT_S
    signalled = None
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            pass
        other = holder(run_dir)
        mine = other is not None and (other.id == claim.id or take_over)
        if other is not None and mine and other.agent_pid and other.agent_pid != signalled and _is_agent(other.agent_pid):
            try:
                os.kill(other.agent_pid, signal.SIGTERM)
            except OSError:
                pass
            signalled = other.agent_pid
        if time.monotonic() > deadline or (other is not None and not mine):
            os.close(fd)
            return other or protocol.SupervisorClaim(id="?", run="", machine="?")
        time.sleep(0.1)
    held = protocol.SupervisorClaim(**{**claim.to_dict(), "agent_pid": os.getpid()})
    tmp = os.path.join(run_dir, f"{protocol.CLAIM_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(held.to_json())
    os.replace(tmp, os.path.join(run_dir, protocol.CLAIM_FILE))
    return fd
