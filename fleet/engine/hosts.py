"""`[[hosts]]`: SSH boxes. A host's actions go in one `python -m worker.hostctl act` (typed JSON
lines on stdin): launches of eight shards are one SSH command and one Python start, and every stop
and restart is carried out on the host by the one door there (intent recorded, group signalled,
escalated, confirmed gone, then the launch). A shard per `gpus_per_shard` GPUs of each host, pinned
to them (CUDA_VISIBLE_DEVICES); a host's shards share their rows, and a lost host's rows may move
to the others."""

from __future__ import annotations

import json

from worker import protocol

from .. import deploy
from ..config import HostSpec
from ..jobs import Placement, sentinel_spec, shard_command
from ..transport import HostUnusable, Transport
from .base import Engine

ACT_TIMEOUT_S = 60.0          # one host's act command (it only records, signals and spawns)


class HostLauncher(Engine):
    moves_rows = True

    def place(self, gpus_by_host: dict[str, list[int]]) -> list[Placement]:
        """One shard per `gpus_per_shard` GPUs of a host (in its GPU order), numbered in
        fleet.toml's host order; GPUs left over (fewer than gpus_per_shard) run nothing."""
        k = self.config.run.gpus_per_shard
        out: list[Placement] = []
        for host in self.config.hosts:
            gpus = gpus_by_host[host.name]
            for i in range(0, len(gpus) - k + 1, k):
                group = tuple(gpus[i:i + k])
                out.append(Placement(len(out), host.name, group[0], group if k > 1 else ()))
        return out

    def preflight_gpus(self, host: HostSpec) -> tuple[str, str]:
        return "all" if host.gpus == "all" else ",".join(map(str, host.gpus)), self.config.run.device

    async def host_checks(self, t: Transport, host: HostSpec, result: deploy.Preflight) -> str:
        n = len(result.gpus)
        return (f"{n} shard(s) on the CPU" if self.config.run.device == "cpu" or not result.report.gpu_count
                else f"{n} GPU(s)")

    def launch_spec(self, host: HostSpec, place: Placement, num_shards: int, pool: list[int]) -> protocol.LaunchSpec:
        """`pool`: the host's shards, which share their rows (worker/leases.py): a host's GPUs
        finish a dead one's rows without a supervisor."""
        cmd = shard_command(self.config, host, place, num_shards, pool)
        return protocol.LaunchSpec(argv=cmd.argv, env=cmd.env, cwd=cmd.cwd, gpu=place.gpu,
                                   sentinels=sentinel_spec(self.config, host), rows=cmd.rows)

    async def act(self, t: Transport, host: HostSpec, actions: list[protocol.ShardAction],
                  places: dict[int, Placement], num_shards: int,
                  wait: float = 0.0) -> list[protocol.ActResult]:
        """Raises HostError when the command could not run (the host is unreachable, or hostctl
        itself failed there: HostUnusable)."""
        for a in actions:
            if a.kind != "stop" and a.launch_spec is None:
                a.launch_spec = self.launch_spec(host, places[a.shard], num_shards, sorted(places))
        argv = ["act", "--run-dir", self.config.run_dir(host)] + (["--wait", str(wait)] if wait else [])
        text = "".join(a.to_json() + "\n" for a in actions)
        r = await t.run(await deploy.worker_argv(t, self.config, host, "hostctl", *argv),
                        timeout=ACT_TIMEOUT_S + wait, input=text.encode())
        if r.rc != 0:
            raise HostUnusable(deploy._python_missing(self.config, host, r.stderr) or
                                      f"{host.name}: worker.hostctl failed (exit {r.rc}): "
                                      f"{deploy.last_line(r.stderr)}")
        results = []
        for line in r.stdout.splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and d.get(protocol.ActResult.TAG) == protocol.ActResult.KIND:
                results.append(protocol.ActResult.from_dict(d))
        return results


    def agent_args(self) -> list[str]:
        return []
