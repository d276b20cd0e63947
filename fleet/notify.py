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
from dataclasses import dataclass
from typing import Callable, Optional

from pydantic import BaseModel, ConfigDict, Field

from .render import finished_summary
from .units import duration
from .schema import FleetSnapshot, ShardStatus, Totals
from .state import State
from .store import Transition

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


def notices(changes: list[Transition], snap: FleetSnapshot) -> list[Notice]:
    """The notices for one decide pass's transitions, `snap` the picture after them: a state
    event per shard that changed (FAILED for a failure whose restart came at once), `finished`
    when this pass finished the run. A transition from no state (a host's replay) is history,
    not news: nothing is told."""
    rows = {s.id: s for s in snap.shards}
    out: list[Notice] = []

    def notice(event: str, message: str, shard: ShardStatus | None = None, previous: str | None = None):
        out.append(Notice(event=event, run=snap.run, time=snap.time, message=message, shard=shard,
                          previous=previous, totals=snap.totals))

    for c in changes:
        s = rows.get(c.shard)
        if c.before is None or s is None:
            continue
        if c.after == State.FAILED or (c.failed and c.before != State.FAILED and c.after != State.FATAL):
            event = State.FAILED.value
            why = s.last_failure if c.after != State.FAILED else s.reason
        else:
            event, why = c.after.value, s.reason
        notice(event, f"{snap.run}: shard {s.id} ({s.host}:{s.gpu}) {c.before.value} -> {c.after.value}"
                      + (f": {why}" if why else ""), s, c.before.value)
    if snap.totals.finished and any(c.before is not None and c.after == State.DONE for c in changes):
        notice("finished", f"{snap.run}: {finished_summary(snap, ' · ')}" + (" → fleet verify" if snap.verifiable else ""))
    return out


@dataclass(frozen=True)
class Alert:
    """The throughput alert as last told."""
    level: str | None = None             # the level last told
    low_since: float | None = None       # snapshot time the throughput went under alert_ratio


def alert_notice(seen: Alert | None, snap: FleetSnapshot, alert_after: float = 0.0) -> tuple[Notice | None, Alert]:
    """`alert` when throughput has stayed under `[expected] alert_ratio` for `alert_after`, or got
    worse (low to critical); `seen` None: the first look, which tells nothing yet (a low rate
    already there is told once it has held)."""
    t = snap.totals
    bad = ALERT_RANK[t.alert_level] > 0
    if seen is None:
        return None, Alert(None, snap.time if bad else None)
    if not bad:
        return None, Alert()
    low_since = seen.low_since if seen.low_since is not None else snap.time
    if snap.time - low_since < alert_after or ALERT_RANK[t.alert_level] <= ALERT_RANK[seen.level]:
        return None, Alert(seen.level, low_since)
    unit = t.ratio_unit or "samples"
    told = Notice(event="alert", run=snap.run, time=snap.time, previous=seen.level or "ok", totals=t,
                  message=f"{snap.run}: throughput {t.ratio:.0%} of expected in {unit} ({t.alert_level}) "
                          f"for {duration(snap.time - low_since)}")
    return told, Alert(t.alert_level, low_since)


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
    """Runs `[notify] command` for the notices a user chose: the supervisor's transitions as
    they are published (`told`), and the throughput alert, looked at every `interval`."""

    def __init__(self, spec, cwd: str, on_log: Callable[[str], None], interval: float = 1.0):
        self.spec = spec
        self.cwd = cwd
        self.on_log = on_log
        self.interval = interval
        self.alert: Alert | None = None
        self._snapshot: Callable[[], FleetSnapshot] | None = None
        self._sends: set[asyncio.Task] = set()

    def told(self, changes: list[Transition]) -> None:
        """Send the chosen notices of one decide pass's transitions (a Supervisor.subscribe listener)."""
        assert self._snapshot is not None, "the supervisor starts the notifier before it subscribes told"
        self._send([n for n in notices(changes, self._snapshot())])

    def _send(self, new: list[Notice]) -> list[Notice]:
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
            async with asyncio.timeout(self.spec.timeout):
                err = await _feed_and_tail(proc, notice.to_json().encode() + b"\n")
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            self.on_log(f"notify: {argv[0]} did not finish in {self.spec.timeout:g}s (killed)")
            return
        if proc.returncode != 0:
            last = (err.decode(errors="replace").strip().splitlines() or ["(no output)"])[-1]
            self.on_log(f"notify: {argv[0]} exited {proc.returncode}: {last[:200]}")

    def start(self, snapshot: Callable[[], FleetSnapshot], group: asyncio.TaskGroup) -> None:
        """Watch the throughput alert in `group` (the supervisor's tasks)."""
        self._snapshot = snapshot

        async def watch() -> None:
            while True:
                try:
                    snap = snapshot()
                    if snap.totals.replayed:
                        told, self.alert = alert_notice(self.alert, snap, self.spec.alert_after)
                        self._send([told] if told else [])
                except Exception as e:                  # never ends the supervisor's tasks
                    self.on_log(f"notify: {type(e).__name__}: {e}")
                await asyncio.sleep(self.interval)
        group.create_task(watch(), name="notify")

    async def close(self) -> None:
        """Wait for the commands still running."""
        if self._sends:
            await asyncio.gather(*self._sends, return_exceptions=True)
