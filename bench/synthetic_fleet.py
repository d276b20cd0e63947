"""A synthetic fleet for the TUI: real ShardRecords, the real judge and the real build_snapshot,
fed made-up typed events instead of SSH. Used by the TUI benchmark (64 hosts x 8 GPUs) and by
visual snapshot and key tests. Deterministic for a given seed and clock.

Like the real worker, samples come longest first (1,400 tokens down to 100 over a shard), so a
shard's samples/s climbs while its tokens/s holds: what the live view must not be fooled by.

It imports no UI: `python bench/tui.py --show` opens the live view on it.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from fleet.actions import refusal
from fleet.config import ExpectedSpec
from fleet.judge import Policy, judge, throughput_history
from fleet.record import ShardRecord
from fleet.snapshot import FleetSnapshot, HostView, ShardView, build_snapshot
from worker import protocol

LONGEST, SHORTEST = 1400, 100           # tokens of a shard's first and last sample


def tokens_before(n: float, total: int) -> float:
    """Tokens of a shard's first n samples, lengths falling linearly from LONGEST to SHORTEST."""
    b = LONGEST - SHORTEST
    return LONGEST * n - b * n * n / (2 * total)


def samples_for(tokens: float, total: int) -> float:
    """The inverse of tokens_before."""
    b = LONGEST - SHORTEST
    disc = LONGEST * LONGEST - 2 * b * tokens / total
    return total if disc <= 0 else min((LONGEST - math.sqrt(disc)) * total / b, total)


class SyntheticFleet:
    def __init__(self, hosts: int = 64, gpus: int = 8, seed: int = 0, per_shard: int = 20000,
                 start: float = 1_700_000_000.0, unreachable: tuple[int, ...] = (),
                 failed: tuple[int, ...] = (), backoff: tuple[int, ...] = (), stalled: tuple[int, ...] = (),
                 stopped: tuple[int, ...] = (), log_lines: int = 30, telemetry: bool = True,
                 usd_per_gpu_hour: float | None = 2.5):
        """failed: FATAL (a failure a restart would meet again); backoff: failed 10 s ago, its
        restart due in 50 s; stalled: alive, no progress for 500 s; stopped: stopped by a user."""
        self.rng = random.Random(seed)
        self.now = start
        self.expected = ExpectedSpec(samples_per_s_per_gpu=3.5, alert_ratio=0.8)
        self.policy = Policy(max_restarts=3, backoff_base=60, backoff_max=60, stall_timeout=120)
        self.hosts: dict[str, HostView] = {}
        self.shards: list[tuple[str, int, ShardRecord]] = []
        self.alive: list[bool] = []
        self.log_lines = log_lines
        self.per_shard = per_shard
        total_tokens = int(tokens_before(per_shard, per_shard))
        for h in range(hosts):
            name = f"box{h:02d}"
            host = HostView(name, f"10.0.{h // 250}.{h % 250 + 1}", reachable=h not in unreachable,
                            error="connection refused" if h in unreachable else None,
                            telemetry="nvml" if telemetry else "none", gpu_t=start, last_seen=start,
                            replayed=True,
                            disk={"path": "/workspace/hs", "free": 12 * 10**12, "total": 30 * 10**12},
                            usd_per_hour=None if usd_per_gpu_hour is None else usd_per_gpu_hour * gpus)
            if telemetry:
                host.gpus = [{"index": g, "name": "NVIDIA H200", "uuid": f"GPU-{h}-{g}",
                              "mem_used": int((60 + g) * 2**30), "mem_total": 150754820096,
                              "util": 90 + g % 10, "temp": 60 + g, "power_w": 550.0 + g,
                              "power_limit_w": 700.0} for g in range(gpus)]
            self.hosts[name] = host
            for g in range(gpus):
                k = len(self.shards)
                r = ShardRecord()
                r.apply(protocol.Launch(t=start - 600, launch=1, by="manual", gpu=g))
                r.apply(protocol.Started(t=start - 599, launch=1, pid=1000 + k, total=per_shard,
                                         total_tokens=total_tokens))
                r.apply(protocol.Loaded(t=start - 500, launch=1))
                self.shards.append((name, g, r))
                self.alive.append(True)
        self.token_rates = [self.rng.uniform(2300.0, 2900.0) for _ in self.shards]
        self.tokens = [self.rng.uniform(0, total_tokens / 4) for _ in self.shards]
        for k, (_, _, r) in enumerate(self.shards):      # where each shard was a second ago
            if k in stalled:
                continue
            d = int(samples_for(self.tokens[k], per_shard))
            tokens = int(tokens_before(d, per_shard))
            r.apply(protocol.Progress(t=start - 1, launch=1, done=d, total=per_shard, tokens=tokens,
                                      bytes=tokens * 40960, total_tokens=total_tokens))
        self.stalled = set(stalled)
        for k in failed:
            self._end(k, protocol.Failed(t=start - 30, reason="CUDA error: an illegal memory access",
                                         fatal=True), code=1)
        for k in backoff:
            self.now = start - 10
            self._end(k, protocol.Failed(t=start - 10, reason="CUDA out of memory"), code=1)
            self.now = start
        for k in stopped:
            self._end(k, protocol.StopRequested(t=start, why="user"), code=-15, stopped=True)
        self.tick(0)

    def _end(self, k: int, before: protocol.Record | None, code: int, stopped: bool = False) -> None:
        r = self.shards[k][2]
        n = r.attempt.n
        if before is not None:
            before.launch = n
            r.apply(before)
        r.apply(protocol.Exited(t=self.now, launch=n, code=code, stopped=stopped))
        self.alive[k] = False

    def tick(self, dt: float = 1.0) -> None:
        """Advance the clock by dt seconds: every live shard reports progress, GPUs move like real
        ones (utilisation, power and memory jitter every second)."""
        second = int(self.now + dt) != int(self.now)
        self.now += dt
        if second:
            for host in self.hosts.values():
                host.gpu_t = self.now
                for g in host.gpus:
                    g["util"] = self.rng.randint(85, 100)
                    g["power_w"] = round(self.rng.uniform(500, 700), 1)
                    g["mem_used"] = int(self.rng.uniform(60, 70) * 2**30)
        for i, (host, _, r) in enumerate(self.shards):
            if not self.alive[i] or r.attempt.phase.value != "RUNNING" or i in self.stalled \
                    or not self.hosts[host].reachable:
                continue
            total_tokens = r.total_tokens
            self.tokens[i] = min(total_tokens, self.tokens[i] + self.token_rates[i] * max(dt, 1.0))
            if self.tokens[i] >= total_tokens:
                self.finish([i])
                continue
            d = int(samples_for(self.tokens[i], r.total))
            tokens = int(tokens_before(d, r.total))
            r.apply(protocol.Progress(t=self.now, launch=r.attempt.n, done=d, total=r.total,
                                      tokens=tokens, bytes=tokens * 40960, skipped=0,
                                      total_tokens=total_tokens))

    def finish(self, ids=None) -> None:
        """Bring shards (default: every live one) to DONE."""
        for k in (range(len(self.shards)) if ids is None else ids):
            _, _, r = self.shards[k]
            if not self.alive[k]:
                continue
            self.tokens[k] = r.total_tokens
            r.apply(protocol.Done(t=self.now, launch=r.attempt.n, done=r.total, total=r.total,
                                  tokens=r.total_tokens, bytes=r.total_tokens * 40960,
                                  total_tokens=r.total_tokens))
            self._end(k, None, code=0)

    def snapshot(self) -> FleetSnapshot:
        views = [ShardView(k, host, gpu, r, judge(r, self.alive[k], self.now, self.policy),
                           self.alive[k], None, self.policy.max_restarts)
                 for k, (host, gpu, r) in enumerate(self.shards)]
        return build_snapshot("synthetic", views, self.hosts, self.now, self.expected)

    def history(self, step: float, points: int) -> list[tuple[float, float, float]]:
        return throughput_history([(r, self.hosts[h].clock_offset) for h, _, r in self.shards],
                                  self.now, step, points)

    def refusal(self, k: int, kind: str) -> str | None:
        _, _, r = self.shards[k]
        return refusal(kind, judge(r, self.alive[k], self.now, self.policy).state, k)

    async def restart(self, ids: list[int]) -> list[str]:
        for k in ids:
            _, gpu, r = self.shards[k]
            n = r.launches + 1
            r.apply(protocol.Launch(t=self.now, launch=n, by="manual", gpu=gpu))
            r.apply(protocol.Loaded(t=self.now, launch=n))
            self.alive[k] = True
        return [f"shard {k}: started" for k in ids]

    async def stop(self, ids: list[int]) -> list[str]:
        for k in ids:
            self._end(k, protocol.StopRequested(t=self.now, why="user"), code=-15, stopped=True)
        return [f"shard {k}: stopped" for k in ids]

    async def stop_all(self) -> list[str]:
        return await self.stop([k for k in range(len(self.shards)) if self.alive[k]])

    async def follow_log(self, shard: int):
        for n in range(self.log_lines):
            yield f"[shard {shard}] progress total=20000 done={n * 35} tokens={n * 25480}"
        yield f"[shard {shard}] warning message=flash-linear-attention not installed: slow GDN kernels"
        await asyncio.Event().wait()          # a quiet, healthy stream
        yield ""
