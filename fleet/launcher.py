"""Who starts and stops shards, and where they run: one Launcher per engine, chosen once from
fleet.toml (`fleet.engines.make_launcher`).

Both engines take the same typed actions (`protocol.ShardAction`: launch, stop, restart) and answer
with `protocol.ActResult`s; the outcome itself (the launch, the end) is read from the shard's record
by the agent, never from how long a command took. The Supervisor keeps the loop and the records and
calls only this interface; it never asks which engine it has. The Launcher also owns placement —
which host, node and GPUs a shard's attempt got, what preflight asks of a host, the hosts the
snapshot shows — so the store, deploy, jobs and plan make no choice by engine; a third engine is
one file beside this one.

- `HostLauncher` (here): `[[hosts]]`. A host's actions go in one `python -m worker.hostctl act`
  (typed JSON lines on stdin): launches of eight shards are one SSH command and one Python start,
  and every stop and restart is carried out on the host by the one door there (intent recorded,
  group signalled, escalated, confirmed gone, then the launch). A shard per `gpus_per_shard` GPUs
  of each host, pinned to them (CUDA_VISIBLE_DEVICES); a lost host's rows may move to the others.
- `SlurmLauncher` (fleet/slurm.py): `[slurm]`. Launches are one `sbatch --array` through
  `worker.slurm submit`; stops and restarts of live tasks are `worker.slurm cancel`; a shard runs on
  whatever node and GPUs Slurm gives its task, which its record and Slurm's word say.
"""

from __future__ import annotations

import json
from typing import ClassVar, Protocol

from worker import protocol

from . import deploy
from .config import Config, HostSpec
from .jobs import Placement, sentinel_spec, shard_command, shard_dir
from .plan import gpu_layout_differences
from .snapshot import ShardView
from .hosts import Host
from .store import Shard, Store
from .transport import HostUnusable, Transport

ACT_TIMEOUT_S = 60.0          # one host's act command (it only records, signals and spawns)


class Launcher(Protocol):
    kind: ClassVar[str | None]        # what the run's plan records as its launcher (None: hosts)
    moves_rows: ClassVar[bool]        # a lost host's rows may go to the others (fleet/relocate.py)

    async def act(self, t: Transport, host: HostSpec, actions: list[protocol.ShardAction],
                  places: dict[int, Placement], num_shards: int,
                  wait: float = 0.0) -> list[protocol.ActResult]: ...

    def log_argv(self, host: HostSpec, shard: int, last: int, follow: bool) -> list[str]: ...

    def agent_args(self) -> list[str]:
        """What the host agent is told about the engine (Slurm: liveness from squeue)."""

    # --- placement ---
    def place(self, gpus_by_host: dict[str, list[int]]) -> list[Placement]:
        """The run's shards and where each runs, for a new plan (`gpus_by_host`: preflight's)."""

    def placements(self, plan: protocol.Plan) -> list[Placement]:
        """The shards of an existing plan, placed as this engine runs them."""

    def first_hosts(self) -> dict[str, Host]:
        """The hosts the supervisor talks to, before any has answered."""

    def view(self, shard: Shard, view: ShardView) -> ShardView:
        """Where the shard's newest attempt runs, as the snapshot shows it."""

    def nodes(self, store: Store) -> dict[str, Host]:
        """Hosts the snapshot shows beside the ones talked to (Slurm: the compute nodes)."""

    def preflight_gpus(self, host: HostSpec) -> tuple[str, str]:
        """(--gpus, --device) for the host's preflight."""

    async def host_checks(self, t: Transport, host: HostSpec, result: deploy.Preflight) -> str:
        """The engine's own checks of a host after its preflight; the words for where its shards run."""


class _Engine:
    """What both engines share: the config, a shard's log read in place on the host, the plan's
    shards as placements, the hosts of fleet.toml, and a view that is the placement's."""
    kind: ClassVar[str | None] = None
    moves_rows: ClassVar[bool] = False
    pinned: ClassVar[bool] = True          # a shard is given its GPUs (CUDA_VISIBLE_DEVICES)

    def __init__(self, config: Config):
        self.config = config

    def log_argv(self, host: HostSpec, shard: int, last: int, follow: bool) -> list[str]:
        # -F follows across the log's creation; tail's own chatter is dropped by the reader.
        return ["tail", "-q", "-n", str(last)] + (["-F"] if follow else []) + \
            [f"{shard_dir(self.config, host, shard)}/log"]

    def layout_differences(self, old: protocol.Plan, new: protocol.Plan) -> list[str]:
        """How two plans of this engine differ in where the shards run (each host's GPUs)."""
        return gpu_layout_differences(old, new)

    def placements(self, plan: protocol.Plan) -> list[Placement]:
        return [Placement(s.id, s.host, s.gpu, tuple(s.gpus) if len(s.gpus) > 1 else (), self.pinned)
                for s in plan.shards]

    def first_hosts(self) -> dict[str, Host]:
        return {h.name: Host(h.name, h.address, usd_per_hour=h.usd_per_hour) for h in self.config.hosts}

    def view(self, shard: Shard, view: ShardView) -> ShardView:
        return view

    def nodes(self, store: Store) -> dict[str, Host]:
        return {}


class HostLauncher(_Engine):
    moves_rows = True

    def place(self, gpus_by_host: dict[str, list[int]]) -> list[Placement]:
        """One shard per `gpus_per_shard` GPUs of a host (in its GPU order), numbered in
        fleet.toml's host order; GPUs left over (fewer than gpus_per_shard) run nothing."""
        k = self.config.run.gpus_per_shard
        out = []
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
