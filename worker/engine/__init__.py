"""The host side of the engines that queue shards as tasks (Slurm, Ray): one module each, found by
name in ENGINES. An engine translates its own states into the neutral words of worker/protocol/
(`TaskState.phase`, `TaskEnded.end`) inside its module, so the agent, the runner and every record
above them name no engine. SSH hosts need no module here: `worker.hostctl` starts their shards.

Standard library only at import: an engine's own client (Ray's) is imported inside its functions,
on the hosts that run it.
"""

from __future__ import annotations

import importlib

from .tasks import Engine

# name -> module (each defines ENGINE, an Engine). One line per engine.
ENGINES = {
    "slurm": "worker.engine.slurm",
    "ray": "worker.engine.ray",
}


def load(name: str, options: dict | None = None) -> Engine:
    """The engine called `name`, given its options (fleet.toml's section, as the hosts need it)."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r} (known: {', '.join(sorted(ENGINES))})")
    return importlib.import_module(ENGINES[name]).make(options or {})
