"""The supervisor's own lateness is never read as the shards' (issue 35): the run's supervisor (the
process `fleet up --headless` started: fleet/service.py) stopped (SIGSTOP) again and again for
seconds at a time (a starved event loop) while its [job] shards run, then stopped for twice its
stall_timeout while they finish, and continued: no shard is judged STALLED, FAILED or UNKNOWN,
nothing is restarted or launched twice, the run ends as it really did, and the supervisor says it
was catching up — to the client that waited for it all along. (The two were a run each, the long
stop a minute at a stall_timeout of 30 s: one run, at 15 s, proves the same in less time.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from tests.conftest import REPO, read_events, wait_for
from tests.fleet.conftest import supervisor_info
from tests.fleet.test_records import job_toml

FALSE = ("-> STALLED", "-> FAILED", "-> BACKOFF", "-> UNKNOWN", "-> FATAL", "unreachable", "(auto)")


def run_headless(config: str):
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "up", "--headless", "-c", config], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(l.rstrip() for l in proc.stdout), daemon=True).start()
    return proc, lines


STALL_S = 15.0
STARVED = [6.0] * 8        # each over fleet/hosts.py's CATCH_UP_S (5 s): lines read that late are a backlog
STOPS = STARVED + [2 * STALL_S]         # ... then one stop of twice the stall timeout, the jobs ending in it


def test_a_stopped_and_starved_supervisor_decides_nothing_false(tmp_path):
    # The jobs tick through the starved stops (each 8 s with the 2 s after it) and end three quarters
    # into the long stop, so their last line is younger than stall_timeout when the supervisor goes on
    # again, as in the minute-long stop at 30 s (its jobs ended 22 s before it went on).
    ticks = int(sum(s + 2.0 for s in STARVED) + 1.5 * STALL_S)
    config = job_toml(tmp_path, {str(k): [[["ticks", ticks, 1.0], ["print", "extract-only mode"]]] for k in range(4)},
                      gpus=(0, 1, 2, 3), stall=f"{STALL_S:.0f}s")
    proc, lines = run_headless(config)
    has = lambda part: any(part in l for l in lines)                     # noqa: E731
    try:
        wait_for(lambda: all(has(f"shard {k} local:{k}") and any(f"shard {k} " in l and "-> RUNNING" in l
                                                                  for l in lines) for k in range(4)),
                 120, what="every shard RUNNING")
        supervisor = supervisor_info(config).pid
        assert supervisor != proc.pid
        for seconds in STOPS:
            os.kill(supervisor, signal.SIGSTOP)
            time.sleep(seconds)
            os.kill(supervisor, signal.SIGCONT)
            time.sleep(2.0)
        assert proc.wait(300) == 0, "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "\n".join(lines)
    assert not [l for l in lines if any(f in l for f in FALSE)], text
    assert "catching up" in text and "caught up" in text, text
    for k in range(4):
        events = read_events(str(tmp_path / "fleet" / "job" / "shards" / str(k)))
        assert [e["by"] for e in events if e["event"] == "launch"] == ["manual"], (k, text)   # launched once
        assert [e.get("code") for e in events if e["event"] == "exited"] == [0]
    assert text.count("-> DONE") == 4


def test_a_supervisor_stopped_past_stall_timeout_after_the_last_line_says_no_stall(tmp_path):
    """The jobs' last line is older than stall_timeout when the supervisor goes on (they ended early
    in its stop): what it judges before it has read its backlog is not published — no STALLED line,
    no restart — and the run ends DONE as it really did."""
    config = job_toml(tmp_path, {str(k): [[["ticks", 5, 1.0], ["print", "extract-only mode"]]] for k in range(2)},
                      gpus=(0, 1), stall="10s")
    proc, lines = run_headless(config)
    try:
        wait_for(lambda: sum("-> RUNNING" in l for l in lines) >= 2, 120, what="both shards RUNNING")
        supervisor = supervisor_info(config).pid
        os.kill(supervisor, signal.SIGSTOP)
        time.sleep(25.0)                               # the jobs end ~5 s in: their last line 20 s old
        os.kill(supervisor, signal.SIGCONT)
        assert proc.wait(120) == 0, "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "\n".join(lines)
    assert not [l for l in lines if any(f in l for f in FALSE)], text
    assert text.count("-> DONE") == 2, text
