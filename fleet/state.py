"""Shard states, the restart policy, throughput maths and the FleetSnapshot: pure code, no I/O.

A shard's state is derived from its host's own record (events.jsonl, replayed by the agent) plus
liveness, so a supervisor that restarts or reconnects rebuilds exactly the same picture. Times in
events are host clocks; stall and rate maths use host time only, so clock skew between the
supervisor and a host never matters.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable

from worker import protocol

SCHEMA = "fleet.status/1"
RATE_WINDOW_S = 30.0


class State(str, Enum):
    PENDING = "PENDING"
    DEPLOYING = "DEPLOYING"
    STARTING = "STARTING"
    LOADING = "LOADING"
    RUNNING = "RUNNING"
    DONE = "DONE"
    STALLED = "STALLED"
    FAILED = "FAILED"
    BACKOFF = "BACKOFF"
    FATAL = "FATAL"
    UNKNOWN = "UNKNOWN"


LIVE = {State.STARTING, State.LOADING, State.RUNNING, State.STALLED}
TERMINAL = {State.DONE, State.FATAL}
FAULTY = {State.FAILED, State.FATAL, State.STALLED}


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class Shard:
    id: int
    host: str
    gpu: int
    needs_done_sentinel: bool = False    # custom job with a `done` regex: exit 0 alone is not DONE
    state: State = State.PENDING
    reason: str | None = None
    done: int = 0
    skipped: int = 0
    total: int = 0
    tokens: int = 0
    bytes: int = 0
    writer_wait_s: float = 0.0
    gpu_mem_bytes: int | None = None
    launches: int = 0
    auto_attempts: int = 0               # automatic launches since the last manual one
    alive: bool | None = None
    pid: int | None = None
    exit_code: int | None = None
    stopped: bool = False                # stopped on purpose: no automatic restart
    done_seen: bool = False
    first_launch_t: float | None = None
    last_event: str | None = None
    last_event_t: float | None = None
    last_progress_t: float | None = None
    warning: str | None = None
    backoff_until: float | None = None   # supervisor clock
    history: deque = field(default_factory=lambda: deque(maxlen=240))

    # --- events --------------------------------------------------------------------------------
    def apply(self, ev: dict) -> None:
        kind, t = ev.get("event"), float(ev.get("t", 0))
        self.last_event, self.last_event_t = kind, t
        if kind == protocol.LAUNCH:
            self.launches += 1
            self.auto_attempts = self.auto_attempts + 1 if ev.get("by") == "auto" else 0
            self.first_launch_t = self.first_launch_t or t
            self.state, self.reason, self.exit_code = State.STARTING, None, None
            self.stopped = self.done_seen = False
            self.backoff_until = None
            self.last_progress_t = t
        elif kind == protocol.STARTED:
            self.state = State.STARTING
            self.pid = ev.get("pid", self.pid)
            self.total = ev.get("total", self.total)
        elif kind == protocol.LOADING:
            self.state = State.LOADING
        elif kind == protocol.LOADED:
            self.state = State.RUNNING
            self.last_progress_t = t
        elif kind == protocol.PROGRESS:
            if self.state not in TERMINAL and self.state != State.FAILED:
                self.state = State.RUNNING
            self._count(ev)
            self.last_progress_t = t
            self.history.append((t, self.done + self.skipped, self.tokens, self.bytes))
        elif kind == protocol.WARNING:
            self.warning = ev.get("message")
        elif kind == protocol.DONE:
            self._count(ev)
            self.done_seen = True
            self.state = State.DONE
            self.history.append((t, self.done + self.skipped, self.tokens, self.bytes))
        elif kind == protocol.FAILED:
            self.state, self.reason = State.FAILED, ev.get("reason", "failed")
        elif kind == protocol.SENTINEL:
            if ev.get("kind") == "done":
                self.done_seen = True
            elif ev.get("kind") == "fail" and self.state not in TERMINAL:
                self.state, self.reason = State.FAILED, f"fail sentinel: {ev.get('line', '').strip()}"
        elif kind == protocol.EXITED:
            self._exited(int(ev.get("code", -1)), bool(ev.get("stopped")))

    def _count(self, ev: dict) -> None:
        for key in ("done", "skipped", "total", "tokens", "bytes", "writer_wait_s", "gpu_mem_bytes"):
            if ev.get(key) is not None:
                setattr(self, key, ev[key])

    def _exited(self, code: int, stopped: bool) -> None:
        self.alive, self.exit_code, self.pid = False, code, None
        if stopped:
            self.state, self.stopped = State.FAILED, True
            self.reason = "stopped"
        elif code == 0 and (self.done_seen or not self.needs_done_sentinel):
            self.state, self.reason = State.DONE, None
        elif code == 0:
            self.state, self.reason = State.FAILED, "exited 0 without the done sentinel"
        else:
            if self.state != State.FAILED or not self.reason:
                self.reason = describe_exit(code)
            self.state = State.FAILED

    # --- liveness and time ---------------------------------------------------------------------
    def set_alive(self, alive: bool, pid: int | None = None) -> None:
        self.alive = alive
        if alive:
            self.pid = pid or self.pid
        elif self.state in LIVE:
            # The runner writes `exited` before the lock goes; no record means it died with the shard.
            self.state, self.reason = State.FAILED, "process vanished without an exit status"

    def check_stall(self, host_now: float, stall_timeout: float) -> None:
        if self.state == State.RUNNING and self.last_progress_t is not None \
                and host_now - self.last_progress_t > stall_timeout:
            self.state = State.STALLED
            self.reason = f"no progress for {host_now - self.last_progress_t:.0f}s"
        elif self.state == State.STALLED and self.last_progress_t is not None \
                and host_now - self.last_progress_t <= stall_timeout:
            self.state, self.reason = State.RUNNING, None

    def rates(self, host_now: float, window: float = RATE_WINDOW_S) -> tuple[float, float, float] | None:
        """(samples/s, tokens/s, bytes/s) over the last `window` s; None when not measured yet."""
        if self.state not in LIVE:
            return None
        if not self.history:
            return None
        recent = []
        for h in reversed(self.history):               # newest first; stop at the window's edge
            if h[0] < host_now - window:
                break
            recent.append(h)
        recent.reverse()
        if len(recent) < 2:
            last = self.history[-1]
            return (0.0, 0.0, 0.0) if host_now - last[0] > window else None
        (t0, s0, k0, b0), (t1, s1, k1, b1) = recent[0], recent[-1]
        dt = max(t1 - t0, 1e-6)
        return ((s1 - s0) / dt, (k1 - k0) / dt, (b1 - b0) / dt)


# --- restart policy ----------------------------------------------------------------------------

def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Capped exponential: base, 2 base, 4 base, ... never above cap."""
    return min(cap, base * (2 ** attempt))


def next_action(shard: Shard, max_restarts: int, restart_stalled: bool) -> str | None:
    """What the supervisor should do with a shard now: 'restart', 'fatal' or None."""
    wants = (shard.state == State.FAILED and not shard.stopped) or \
            (shard.state == State.STALLED and restart_stalled)
    if not wants:
        return None
    return "fatal" if shard.auto_attempts >= max_restarts else "restart"


# --- hosts and the snapshot --------------------------------------------------------------------

@dataclass
class Host:
    name: str
    address: str
    reachable: bool | None = None        # None: not tried yet
    error: str | None = None
    telemetry: str | None = None         # nvml | nvidia-smi | none
    gpus: list = field(default_factory=list)
    gpu_t: float | None = None           # host clock of the last GPU reading
    disk: dict | None = None
    clock_offset: float = 0.0            # host clock - supervisor clock
    last_seen: float | None = None       # supervisor clock
    disk_history: deque = field(default_factory=lambda: deque(maxlen=120))

    def host_now(self, now: float) -> float:
        return now + self.clock_offset


def _finite(x: float | None, digits: int = 2) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, digits)


def build_snapshot(run: str, shards: Iterable[Shard], hosts: dict[str, Host], now: float,
                   expected: Any) -> dict:
    """The one typed picture of the fleet: what `status --json` prints and what the TUI draws."""
    shards = list(shards)
    rows, by_state = [], {s.value: 0 for s in State}
    sps = tps = 0.0
    measured = False
    host_bps: dict[str, float] = {}
    for s in shards:
        host = hosts[s.host]
        hn = host.host_now(now)
        shown = State.UNKNOWN if host.reachable is False else s.state
        by_state[shown.value] += 1
        r = s.rates(hn) if host.reachable else None
        if r is not None:
            measured = True
            sps += r[0]
            tps += r[1]
            host_bps[s.host] = host_bps.get(s.host, 0.0) + r[2]
        rows.append({
            "id": s.id, "host": s.host, "gpu": s.gpu, "state": shown.value,
            "reason": s.reason if shown != State.UNKNOWN else f"host unreachable: {host.error}",
            "done": s.done, "skipped": s.skipped, "total": s.total,
            "progress": _finite((s.done + s.skipped) / s.total, 4) if s.total else None,
            "tokens": s.tokens, "bytes": s.bytes,
            "samples_per_s": _finite(r[0]) if r else None, "tokens_per_s": _finite(r[1], 1) if r else None,
            "restarts": max(s.launches - 1, 0), "auto_attempts": s.auto_attempts,
            "alive": s.alive if host.reachable else None, "pid": s.pid, "exit_code": s.exit_code,
            "last_event": s.last_event,
            "last_event_age_s": _finite(hn - s.last_event_t, 1) if s.last_event_t else None,
            "backoff_s": _finite(s.backoff_until - now, 1) if s.backoff_until else None,
            "writer_wait_s": s.writer_wait_s, "gpu_mem_bytes": s.gpu_mem_bytes, "warning": s.warning,
        })
    total = sum(s.total for s in shards)
    finished = sum(s.done + s.skipped for s in shards)
    per_gpu, unit = (expected.samples_per_s_per_gpu, "samples") if expected.samples_per_s_per_gpu \
        else (expected.tokens_per_s_per_gpu, "tokens")
    running = sum(1 for s in shards if s.state in (State.RUNNING, State.STALLED))
    expected_rate = per_gpu * running if per_gpu else None
    actual = sps if unit == "samples" else tps
    ratio = actual / expected_rate if expected_rate and measured else None
    remaining = max(total - finished, 0)
    eta = remaining / sps if sps > 0 else (0.0 if total and remaining == 0 else None)
    disk_eta = None
    host_rows = []
    for h in hosts.values():
        bps = host_bps.get(h.name, 0.0)
        free = (h.disk or {}).get("free")
        if free is not None and bps > 0 and h.reachable:
            disk_eta = min(disk_eta or math.inf, free / bps)
        host_rows.append({
            "name": h.name, "address": h.address, "reachable": h.reachable, "error": h.error,
            "telemetry": h.telemetry if h.reachable else None,
            "gpus": h.gpus if h.reachable else None,
            "gpu_age_s": _finite(h.host_now(now) - h.gpu_t, 1) if h.gpu_t and h.reachable else None,
            "disk": h.disk if h.reachable else None,
            "last_seen_age_s": _finite(now - h.last_seen, 1) if h.last_seen else None,
        })
    starts = [s.first_launch_t for s in shards if s.first_launch_t]
    elapsed = None
    if starts:
        first_host = hosts[next(s.host for s in shards if s.first_launch_t == min(starts))]
        elapsed = first_host.host_now(now) - min(starts)
    return {
        "schema": SCHEMA, "run": run, "time": round(now, 3),
        "hosts": host_rows, "shards": rows,
        "totals": {
            "shards": len(shards), "by_state": {k: v for k, v in by_state.items() if v},
            "done": finished, "total": total,
            "samples_per_s": _finite(sps) if measured else None,
            "tokens_per_s": _finite(tps, 1) if measured else None,
            "expected_unit": unit if per_gpu else None,
            "expected_per_s": _finite(expected_rate) if expected_rate else None,
            "ratio": _finite(ratio, 3), "alert": bool(ratio is not None and ratio < expected.alert_ratio),
            "eta_s": _finite(eta, 0), "elapsed_s": _finite(elapsed, 1),
            "bytes_written": sum(s.bytes for s in shards),
            "disk_full_eta_s": _finite(disk_eta, 0),
        },
    }


def status_exit_code(snapshot: dict) -> int:
    """0 healthy or done, 1 a shard FAILED/FATAL/STALLED, 3 a host unreachable."""
    if any(h["reachable"] is False for h in snapshot["hosts"]):
        return 3
    if any(s["state"] in {x.value for x in FAULTY} for s in snapshot["shards"]):
        return 1
    return 0
