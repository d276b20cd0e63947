"""What every engine's Launcher shares: the config, a shard's log read in place on the host, the
plan's shards as placements, the hosts of fleet.toml, and a view that is the placement's."""

from __future__ import annotations

from typing import ClassVar

from worker import protocol

from ..config import Config, HostSpec
from ..hosts import Host
from ..jobs import Placement, shard_dir
from ..plan import gpu_layout_differences
from ..snapshot import ShardView
from ..store import Shard, Store


class Engine:
    """The shared part of a Launcher (fleet/engine/__init__.py)."""
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
