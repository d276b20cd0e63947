"""A host's follow loop ends when it is cancelled, whatever arrives with the cancel: Python 3.11's
`asyncio.wait_for` returns a result that lands in the same loop pass as the cancel and drops the
cancel, so a follow loop built on it reads on forever and `Supervisor.close` (a TaskGroup waiting
for its children) never returns — the hang seen in test_actions under CI load."""

from __future__ import annotations

import asyncio

from fleet.config import load_config
from fleet.bundle import code_dir
from fleet.supervisor import Supervisor
from fleet.transport import Stream, Transport

from .test_records import job_toml


class QueueStream(Stream):
    def __init__(self, queue: asyncio.Queue):
        self.queue = queue

    async def lines(self):
        while True:
            yield await self.queue.get()

    async def close(self) -> None:
        pass


class QueueTransport(Transport):
    """An agent stream whose lines the test puts there itself, at a moment it chooses."""

    def __init__(self, host, queue: asyncio.Queue):
        super().__init__(host)
        self.queue = queue

    async def connect(self) -> None:
        pass

    async def stream(self, argv: list[str]) -> Stream:
        return QueueStream(self.queue)


async def test_a_cancel_that_arrives_with_a_line_ends_the_follow_loop(tmp_path):
    config = load_config(job_toml(tmp_path, {"0": []}, gpus=(0,)))
    sup = Supervisor(config)
    link = sup.links["local"]
    queue: asyncio.Queue = asyncio.Queue()
    link.transport = QueueTransport(link.spec, queue)
    link.transport.worker_at = code_dir(config, link.spec)      # nothing to upload
    for trial in range(20):
        task = asyncio.create_task(link.follow())
        await asyncio.sleep(0.05)                               # waiting for its next line
        queue.put_nowait("a diagnostic line\n")
        task.cancel()                                           # in the same loop pass
        done, _ = await asyncio.wait([task], timeout=2)
        assert done, f"trial {trial}: the follow loop read on after its cancel"
        assert task.cancelled()


async def test_a_close_whose_task_ignores_its_cancel_returns_and_says_so(tmp_path, monkeypatch):
    """Whatever a task does with its cancel, quitting `fleet up` returns (naming the task)."""
    from fleet import supervisor
    monkeypatch.setattr(supervisor, "CLOSE_TIMEOUT_S", 0.5)
    logs: list[str] = []
    sup = Supervisor(load_config(job_toml(tmp_path, {"0": []}, gpus=(0,))), on_log=logs.append)
    released = asyncio.Event()

    async def deaf() -> None:                                   # drops every cancel until released
        while not released.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                pass
    sup.links["local"].follow = deaf
    await sup.start()
    await asyncio.wait_for(sup.close(), 10)
    assert any("did not stop within 0s" in m or "did not stop within 1s" in m for m in logs), logs
    assert any("host-local" in m for m in logs), logs
    released.set()


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 30), st.floats(-5, 5)), min_size=1, max_size=60))
def test_the_clock_offset_is_the_largest_of_the_last_minute(steps):
    """Host.heard keeps a sliding-window maximum (it took the max over every line of the minute, at
    every line: a third of the supervisor's CPU at 64 hosts); the naive maximum over the lines
    heard in the window, computed apart, agrees at every line."""
    from fleet.hosts import OFFSET_WINDOW_S, Host
    host, now, heard = Host("h", "127.0.0.1"), 1000.0, []
    for dt, offset in steps:
        now += dt
        host.heard(now + offset, now)
        heard.append((now, (now + offset) - now))          # the offset as the host's stamp gives it
        assert host.clock_offset == max(o for t, o in heard if t >= now - OFFSET_WINDOW_S)
