"""A host's wall clock steps (ntpd, a VM resumed) while its shards run: stalls are judged on the
host agent's monotonic clock, so a step forward stalls nothing and a step back hides no stall.

The host side (agent, hostctl, runner, job) runs with tests/faults/clock on its PYTHONPATH, whose
sitecustomize shifts time.time() by what the test writes into a file; the supervisor (this process)
keeps the real clock, as it would on another machine."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from fleet.config import load_config
from fleet.state import State
from fleet.supervisor import Supervisor
from tests.fleet.test_records import file_events, job_toml, shard, started, until
from worker import protocol

CLOCK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "clock")


def stepping_python(tmp_path) -> tuple[str, str]:
    """A host python whose processes share one steppable wall clock (the file it returns)."""
    clock = tmp_path / "clock-shift"
    clock.write_text("0")
    wrapper = tmp_path / "python"
    wrapper.write_text(f"#!/bin/sh\nexport PYTHONPATH={CLOCK}:$PYTHONPATH FLEET_TEST_CLOCK_FILE={clock}\n"
                       f"exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper), str(clock)


async def test_a_wall_clock_step_either_way_neither_stalls_a_shard_nor_hides_a_stall(tmp_path):
    python, clock = stepping_python(tmp_path)
    script = {"0": [[["ticks", 100000, 0.2]]]}
    sup = await started(job_toml(tmp_path, script, gpus=(0,), stall="3s", backoff="0.5s", python=python))
    try:
        await until(lambda: shard(sup, 0).done >= 5, what="running")
        open(clock, "w").write("3600")                              # one hour forward
        seen = set()
        for _ in range(40):                                         # 8 s: over twice stall_timeout
            seen.add(shard(sup, 0).state)
            await asyncio.sleep(0.2)
        assert seen == {State.RUNNING}, seen
        assert len([e for e in file_events(tmp_path, 0) if isinstance(e, protocol.Launch)]) == 1
        ahead = max(e.t for e in file_events(tmp_path, 0))
        open(clock, "w").write("-3600")                             # one hour back, and then frozen
        await until(lambda: any(isinstance(e, protocol.Progress) and e.t < ahead - 3600
                                for e in file_events(tmp_path, 0)), what="progress stamped after the step back")
        os.kill(shard(sup, 0).pid, signal.SIGSTOP)
        await until(lambda: shard(sup, 0).state in (State.STALLED, State.STOPPING), timeout=20,
                    what="the frozen shard seen stalled")
        assert shard(sup, 0).reason.startswith(("no progress for", "restarting (no progress for"))
    finally:
        await sup.close()
        await Supervisor(load_config(str(tmp_path / "fleet.toml"))).stop_all(timeout=1)
