"""Who starts and stops shards, and where they run: one Launcher per engine, each a module of this
package, chosen once from fleet.toml by `make_launcher` (the section present: [slurm], [ray], or
[[hosts]]).

Every engine takes the same typed actions (`protocol.ShardAction`: launch, stop, restart) and answers
with `protocol.ActResult`s; the outcome itself (the launch, the end) is read from the shard's record
by the agent, never from how long a command took. The Supervisor keeps the loop and the records and
calls only this interface; it never asks which engine it has. The Launcher also owns placement —
which host, node and GPUs a shard's attempt got, what preflight asks of a host, the hosts the
snapshot shows — so the store, deploy, jobs and plan make no choice by engine. An engine's own
words (Slurm's PENDING, Ray's DEAD) are translated into neutral ones on the hosts (worker/engine/)
before anything here reads them.

- `hosts` (`HostLauncher`): `[[hosts]]`, SSH boxes. A host's actions go in one `python -m
  worker.hostctl act`; a shard per `gpus_per_shard` GPUs of each host, pinned to them; a host's
  shards share their rows, and a lost host's rows may move to the others.
- `tasks` (`TaskLauncher`): what engines that queue shards as tasks share — a login (or head)
  node fleet talks to, `python -m worker.engine.<name> submit | cancel | cancel-all` there, shards
  placed by the engine on its nodes, shown as hosts with the GPUs the tasks report.
- `slurm` (`SlurmLauncher`): `[slurm]`, one array task per shard.
- `ray` (`RayLauncher`): `[ray]`, one Ray actor per shard on a Ray cluster.
"""

from __future__ import annotations

import importlib
from typing import ClassVar, Protocol

from worker import protocol

from .. import deploy
from ..config import Config, HostSpec
from ..hosts import Host
from ..jobs import Placement
from ..snapshot import ShardView
from ..store import Shard, Store
from ..transport import Transport

# fleet.toml's engine (Config.engine) -> "module:class". One line per engine.
ENGINES = {
    "hosts": "fleet.engine.hosts:HostLauncher",
    "slurm": "fleet.engine.slurm:SlurmLauncher",
    "ray": "fleet.engine.ray:RayLauncher",
}


class Launcher(Protocol):
    kind: ClassVar[str | None]        # what the run's plan records as its launcher (None: hosts)
    moves_rows: ClassVar[bool]        # a lost host's rows may go to the others (fleet/relocate.py)

    async def act(self, t: Transport, host: HostSpec, actions: list[protocol.ShardAction],
                  places: dict[int, Placement], num_shards: int,
                  wait: float = 0.0) -> list[protocol.ActResult]: ...

    def log_argv(self, host: HostSpec, shard: int, last: int, follow: bool) -> list[str]: ...

    def agent_args(self) -> list[str]:
        """What the host agent is told about the engine (an engine of tasks: which, and how often
        to ask it)."""
        ...

    # --- placement ---
    def place(self, gpus_by_host: dict[str, list[int]]) -> list[Placement]:
        """The run's shards and where each runs, for a new plan (`gpus_by_host`: preflight's)."""
        ...

    def placements(self, plan: protocol.Plan) -> list[Placement]:
        """The shards of an existing plan, placed as this engine runs them."""
        ...

    def layout_differences(self, old: protocol.Plan, new: protocol.Plan) -> list[str]:
        """How two plans of this engine differ in where the shards run."""
        ...

    def first_hosts(self) -> dict[str, Host]:
        """The hosts the supervisor talks to, before any has answered."""
        ...

    def view(self, shard: Shard, view: ShardView) -> ShardView:
        """Where the shard's newest attempt runs, as the snapshot shows it."""
        ...

    def nodes(self, store: Store) -> dict[str, Host]:
        """Hosts the snapshot shows beside the ones talked to (an engine's nodes)."""
        ...

    def preflight_gpus(self, host: HostSpec) -> tuple[str, str]:
        """(--gpus, --device) for the host's preflight."""
        ...

    async def host_checks(self, t: Transport, host: HostSpec, result: deploy.Preflight) -> str:
        """The engine's own checks of a host after its preflight; the words for where its shards run."""
        ...


def make_launcher(config: Config) -> Launcher:
    module, _, name = ENGINES[config.engine].partition(":")
    return getattr(importlib.import_module(module), name)(config)
