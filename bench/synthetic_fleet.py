"""A synthetic fleet for the TUI: real Shard/Host objects and the real build_snapshot, fed made-up
events instead of SSH. Used by the TUI benchmark (64 hosts x 8 GPUs) and by visual snapshot tests.
Deterministic for a given seed and clock."""

from __future__ import annotations

import asyncio
import random

from fleet.config import ExpectedSpec
from fleet.state import Host, Shard, build_snapshot


class SyntheticFleet:
    def __init__(self, hosts: int = 64, gpus: int = 8, seed: int = 0, per_shard: int = 20000,
                 start: float = 1_700_000_000.0, unreachable: tuple[int, ...] = (),
                 failed: tuple[int, ...] = (), log_lines: int = 30):
        self.rng = random.Random(seed)
        self.now = start
        self.expected = ExpectedSpec(samples_per_s_per_gpu=3.5, alert_ratio=0.8)
        self.hosts: dict[str, Host] = {}
        self.shards: list[Shard] = []
        self.log_lines = log_lines
        for h in range(hosts):
            name = f"box{h:02d}"
            host = Host(name, f"10.0.{h // 250}.{h % 250 + 1}", reachable=h not in unreachable,
                        error="connection refused" if h in unreachable else None,
                        telemetry="nvml", gpu_t=start, last_seen=start,
                        disk={"path": "/workspace/hs", "free": 12 * 10**12, "total": 30 * 10**12})
            host.gpus = [{"index": g, "name": "NVIDIA H200", "uuid": f"GPU-{h}-{g}",
                          "mem_used": int((60 + g) * 2**30), "mem_total": 141 * 2**30,
                          "util": 90 + g % 10, "temp": 60 + g, "power_w": 550.0 + g} for g in range(gpus)]
            self.hosts[name] = host
            for g in range(gpus):
                s = Shard(len(self.shards), name, g)
                s.apply({"event": "launch", "t": start - 600, "by": "manual", "gpu": g})
                s.apply({"event": "started", "t": start - 599, "pid": 1000 + len(self.shards), "total": per_shard})
                s.apply({"event": "loaded", "t": start - 500})
                s.alive = True
                self.shards.append(s)
        self.rates = [self.rng.uniform(3.0, 4.0) for _ in self.shards]
        self.done = [self.rng.randint(0, per_shard // 4) for _ in self.shards]
        for k in failed:
            self.shards[k].apply({"event": "failed", "t": start - 30, "reason": "CUDA out of memory"})
            self.shards[k].apply({"event": "exited", "t": start - 30, "code": 1})
        self.tick(0)

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
        for i, s in enumerate(self.shards):
            if s.state.value != "RUNNING":
                continue
            self.done[i] = min(s.total, self.done[i] + self.rates[i] * max(dt, 1.0))
            d = int(self.done[i])
            s.apply({"event": "progress", "t": self.now, "done": d, "total": s.total,
                     "tokens": d * 728, "bytes": d * 728 * 40960, "skipped": 0})

    def snapshot(self) -> dict:
        return build_snapshot("synthetic", self.shards, self.hosts, self.now, self.expected)

    async def restart(self, ids: list[int]) -> list[str]:
        for k in ids:
            self.shards[k].apply({"event": "launch", "t": self.now, "by": "manual", "gpu": self.shards[k].gpu})
            self.shards[k].apply({"event": "loaded", "t": self.now})
        return [f"shard {k}: started" for k in ids]

    async def stop(self, ids: list[int]) -> list[str]:
        for k in ids:
            self.shards[k].apply({"event": "exited", "t": self.now, "code": -15, "stopped": True})
        return [f"shard {k}: stopped" for k in ids]

    async def stop_all(self) -> list[str]:
        return await self.stop([s.id for s in self.shards if s.alive])

    async def follow_log(self, shard: int):
        for n in range(self.log_lines):
            yield f"[shard {shard}] progress total=20000 done={n * 35} tokens={n * 25480}"
        await asyncio.Event().wait()          # a quiet, healthy stream
        yield ""
