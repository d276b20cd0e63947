"""Told, not watched: what changed between two snapshots, as typed notices, and the `[notify]`
command the supervisor runs for the ones a user chose.

`notices()` is pure (snapshots in, notices out) and is the one place that says what counts as a
change worth telling: the live view's toasts use it too. `Notifier` runs `[notify] command` (split
like a `[job]` command, never by a shell) on the supervisor's machine, one process per notice, the
notice as JSON on its stdin, in fleet.toml's folder; a command that fails or hangs is logged and
killed after `timeout`, and never stops supervision.

Events (`[notify] on`): a state name when a shard enters that state; `FAILED` also when an attempt
ends in failure and the judge moves the shard straight to BACKOFF (a restart is due) — every
failure is told once, the final one as `FATAL`; `alert` when throughput has stayed under
`[expected] alert_ratio` for `alert_after` (or got worse: low to critical); `finished` when every
shard is DONE. Only changes seen while watching count: attaching to a run replays its history
without a notice.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict, Field

from .render import finished_summary
from .units import duration
from .snapshot import FleetSnapshot, ShardStatus, Totals
from .state import State

SCHEMA = "fleet.notify/1"
ALERT_RANK = {None: 0, "ok": 0, "low": 1, "critical": 2}


class Notice(BaseModel):
    """What the `[notify]` command reads on its stdin (one JSON object)."""
    model_config = ConfigDict(populate_by_name=True)

    schema_: str = Field(SCHEMA, alias="schema")
    event: str = Field(description="a state name (the shard entered it; FAILED: an attempt failed), "
                                   "alert or finished")
    run: str
    time: float = Field(description="unix seconds")
    message: str = Field(description="one line for a person")
    shard: Optional[ShardStatus] = Field(None, description="the shard, for a state event")
    previous: Optional[str] = Field(None, description="its state before (alert: the level before)")
    totals: Totals

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True)


@dataclass
class Seen:
    """What the last snapshot said, to tell what changed since."""
    states: dict[int, str] = field(default_factory=dict)
    failures: dict[int, int] = field(default_factory=dict)
    alert: str | None = None             # the level last told
    low_since: float | None = None       # snapshot time the throughput went under alert_ratio
    finished: bool = False


def notices(seen: Seen | None, snap: FleetSnapshot, alert_after: float = 0.0) -> tuple[list[Notice], Seen]:
    """The notices between the snapshot `seen` summed up and `snap`; None: this is the first
    snapshot watched, which tells nothing (its history happened before)."""
    t = snap.totals
    now = Seen(states={s.id: s.state.value for s in snap.shards},
               failures={s.id: s.failures for s in snap.shards}, finished=t.finished)
    bad = ALERT_RANK[t.alert_level] > 0
    if seen is None:                     # a low rate already there is told once it has held
        now.low_since = snap.time if bad else None
        return [], now
    out: list[Notice] = []

    def notice(event: str, message: str, shard: ShardStatus | None = None, previous: str | None = None):
        out.append(Notice(event=event, run=snap.run, time=snap.time, message=message, shard=shard,
                          previous=previous, totals=t))

    for s in snap.shards:
        before = seen.states.get(s.id)
        failed = s.failures > seen.failures.get(s.id, s.failures)
        if before == s.state.value and not failed:
            continue
        if s.state == State.FAILED or (failed and before != State.FAILED.value and s.state != State.FATAL):
            event = State.FAILED.value
            why = s.last_failure if s.state != State.FAILED else s.reason
        else:
            event, why = s.state.value, s.reason
        notice(event, f"{snap.run}: shard {s.id} ({s.host}:{s.gpu}) {before or '-'} -> {s.state.value}"
                      + (f": {why}" if why else ""), s, before)

    now.low_since = (seen.low_since if seen.low_since is not None else snap.time) if bad else None
    now.alert = seen.alert if bad else None
    held = bad and snap.time - now.low_since >= alert_after
    if held and ALERT_RANK[t.alert_level] > ALERT_RANK[seen.alert]:
        unit = t.ratio_unit or "samples"
        notice("alert", f"{snap.run}: throughput {t.ratio:.0%} of expected in {unit} ({t.alert_level}) "
                        f"for {duration(snap.time - now.low_since)}", previous=seen.alert or "ok")
        now.alert = t.alert_level
    if t.finished and not seen.finished:
        notice("finished", f"{snap.run}: {finished_summary(snap, ' · ')} → fleet verify")
    return out, now


STDERR_TAIL = 1 << 16          # bytes of a notify command's stderr kept: its last line is what is told


async def _feed_and_tail(proc, data: bytes) -> bytes:
    """Write the notice to the command's stdin, then read its stderr to the end keeping only the
    tail (communicate() would keep all of it: a command flooding stderr grew `fleet up` to GBs)."""
    try:
        proc.stdin.write(data)
        await proc.stdin.drain()
        proc.stdin.close()
    except (BrokenPipeError, ConnectionResetError):
        pass
    tail = b""
    while chunk := await proc.stderr.read(1 << 16):
        tail = (tail + chunk)[-STDERR_TAIL:]
    await proc.wait()
    return tail


class Notifier:
    """Runs `[notify] command` for the notices a user chose, following a supervisor's snapshots."""

    def __init__(self, spec, cwd: str, on_log: Callable[[str], None], interval: float = 0.25):
        self.spec = spec
        self.cwd = cwd
        self.on_log = on_log
        self.interval = interval
        self.seen: Seen | None = None
        self._sends: set[asyncio.Task] = set()
        self._task: asyncio.Task | None = None

    def check(self, snap: FleetSnapshot) -> list[Notice]:
        """Tell what changed since the last check (call it only on a replayed picture)."""
        new, self.seen = notices(self.seen, snap, self.spec.alert_after)
        chosen = [n for n in new if n.event in self.spec.on]
        for n in chosen:
            task = asyncio.create_task(self.send(n))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)
        return chosen

    async def send(self, notice: Notice) -> None:
        argv = self.spec.argv
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=self.cwd, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            self.on_log(f"notify: cannot run {argv[0]}: {e.strerror or e}")
            return
        try:
            err = await asyncio.wait_for(_feed_and_tail(proc, notice.to_json().encode() + b"\n"),
                                         self.spec.timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            self.on_log(f"notify: {argv[0]} did not finish in {self.spec.timeout:g}s (killed)")
            return
        if proc.returncode != 0:
            last = (err.decode(errors="replace").strip().splitlines() or ["(no output)"])[-1]
            self.on_log(f"notify: {argv[0]} exited {proc.returncode}: {last[:200]}")

    def start(self, snapshot: Callable[[], FleetSnapshot], replayed: Callable[[], bool]) -> None:
        async def loop() -> None:
            while not replayed():            # the first look is the baseline: take it at once, so
                await asyncio.sleep(0.05)    # a failure soon after attaching is told, not absorbed
            while True:
                self.check(snapshot())
                await asyncio.sleep(self.interval)
        self._snapshot, self._replayed = snapshot, replayed
        self._task = asyncio.create_task(loop(), name="notify")

    async def close(self) -> None:
        """One last look (a run that just finished is told), then wait for the commands running."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            if self._replayed():
                self.check(self._snapshot())
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)
