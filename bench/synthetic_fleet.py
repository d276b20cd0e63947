"""A synthetic fleet for the TUI: real ShardRecords, the real judge and the real build_snapshot,
fed made-up typed events instead of SSH. Used by the TUI benchmark (64 hosts x 8 GPUs) and by
visual snapshot tests. Deterministic for a given seed and clock."""

from __future__ import annotations

import asyncio
import random

from fleet.config import ExpectedSpec
from fleet.judge import Policy, judge
from fleet.record import ShardRecord
from fleet.snapshot import FleetSnapshot, HostView, ShardView, build_snapshot
from worker import protocol


class SyntheticFleet:
    def __init__(self, hosts: int = 64, gpus: int = 8, seed: int = 0, per_shard: int = 20000,
                 start: float = 1_700_000_000.0, unreachable: tuple[int, ...] = (),
                 failed: tuple[int, ...] = (), log_lines: int = 30):
        self.rng = random.Random(seed)
        self.now = start
        self.expected = ExpectedSpec(samples_per_s_per_gpu=3.5, alert_ratio=0.8)
        self.policy = Policy(max_restarts=0)              # a failure stays visible: FATAL
        self.hosts: dict[str, HostView] = {}
        self.shards: list[tuple[str, int, ShardRecord]] = []
        self.alive: list[bool] = []
        self.log_lines = log_lines
        for h in range(hosts):
            name = f"box{h:02d}"
            host = HostView(name, f"10.0.{h // 250}.{h % 250 + 1}", reachable=h not in unreachable,
                            error="connection refused" if h in unreachable else None,
                            telemetry="nvml", gpu_t=start, last_seen=start, replayed=True,
                            disk={"path": "/workspace/hs", "free": 12 * 10**12, "total": 30 * 10**12})
            host.gpus = [{"index": g, "name": "NVIDIA H200", "uuid": f"GPU-{h}-{g}",
                          "mem_used": int((60 + g) * 2**30), "mem_total": 141 * 2**30,
                          "util": 90 + g % 10, "temp": 60 + g, "power_w": 550.0 + g} for g in range(gpus)]
            self.hosts[name] = host
            for g in range(gpus):
                k = len(self.shards)
                r = ShardRecord()
                r.apply(protocol.Launch(t=start - 600, launch=1, by="manual", gpu=g))
                r.apply(protocol.Started(t=start - 599, launch=1, pid=1000 + k, total=per_shard))
                r.apply(protocol.Loaded(t=start - 500, launch=1))
                self.shards.append((name, g, r))
                self.alive.append(True)
        self.rates = [self.rng.uniform(3.0, 4.0) for _ in self.shards]
        self.done = [self.rng.randint(0, per_shard // 4) for _ in self.shards]
        for k in failed:
            self._end(k, protocol.Failed(t=start - 30, reason="CUDA out of memory"), code=1)
        self.tick(0)

    def _end(self, k: int, before: protocol.Record | None, code: int) -> None:
        r = self.shards[k][2]
        n = r.attempt.n
        if before is not None:
            before.launch = n
            r.apply(before)
        r.apply(protocol.Exited(t=self.now, launch=n, code=code))
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
        for i, (_, _, r) in enumerate(self.shards):
            if not self.alive[i] or r.attempt.phase.value != "RUNNING":
                continue
            self.done[i] = min(r.total, self.done[i] + self.rates[i] * max(dt, 1.0))
            d = int(self.done[i])
            r.apply(protocol.Progress(t=self.now, launch=r.attempt.n, done=d, total=r.total,
                                      tokens=d * 728, bytes=d * 728 * 40960, skipped=0))

    def snapshot(self) -> FleetSnapshot:
        views = [ShardView(k, host, gpu, r, judge(r, self.alive[k], self.now, self.policy),
                           self.alive[k], None, self.policy.max_restarts)
                 for k, (host, gpu, r) in enumerate(self.shards)]
        return build_snapshot("synthetic", views, self.hosts, self.now, self.expected)

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
            self._end(k, protocol.StopRequested(t=self.now, why="user"), code=-15)
        return [f"shard {k}: stopped" for k in ids]

    async def stop_all(self) -> list[str]:
        return await self.stop([k for k in range(len(self.shards)) if self.alive[k]])

    async def follow_log(self, shard: int):
        for n in range(self.log_lines):
            yield f"[shard {shard}] progress total=20000 done={n * 35} tokens={n * 25480}"
        await asyncio.Event().wait()          # a quiet, healthy stream
        yield ""
