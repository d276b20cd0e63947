"""Which engine runs the shards: chosen once, from fleet.toml ([slurm] or [[hosts]])."""

from __future__ import annotations

from .config import Config
from .launcher import HostLauncher, Launcher
from .slurm import SlurmLauncher


def make_launcher(config: Config) -> Launcher:
    return SlurmLauncher(config) if config.slurm is not None else HostLauncher(config)
