"""The supervisor's own lateness is never read as the shards' (issue 35): the run's supervisor (the
process `fleet up --headless` started: fleet/service.py) stopped (SIGSTOP) for a minute (twice its
stall_timeout; it was two, which cost CI a minute more and tested nothing more) while its
[job] shards run and finish, then continued, and stopped again and again for seconds at a time (a
starved event loop): no shard is judged STALLED, FAILED or UNKNOWN, nothing is restarted or launched
twice, the run ends as it really did, and the supervisor says it was catching up — to the client
that waited for it all along."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

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


@pytest.mark.parametrize("stops", [[60.0], [6.0] * 8], ids=["a-minute", "starved"])
def test_a_stopped_or_starved_supervisor_decides_nothing_false(tmp_path, stops):
    ticks = 40 if len(stops) == 1 else 70
    config = job_toml(tmp_path, {str(k): [[["ticks", ticks, 1.0], ["print", "extract-only mode"]]] for k in range(4)},
                      gpus=(0, 1, 2, 3), stall="30s")
    proc, lines = run_headless(config)
    has = lambda part: any(part in l for l in lines)                     # noqa: E731
    try:
        wait_for(lambda: all(has(f"shard {k} local:{k}") and any(f"shard {k} " in l and "-> RUNNING" in l
                                                                  for l in lines) for k in range(4)),
                 120, what="every shard RUNNING")
        supervisor = supervisor_info(config).pid
        assert supervisor != proc.pid
        for seconds in stops:
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
