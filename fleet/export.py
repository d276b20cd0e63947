"""`fleet export`: convert the run's output on every host to another trainer's layout.

Each host converts its own output folder (`python -m worker.export`, no GPU needed) into a new
folder; this module runs that everywhere in parallel and collects the summaries.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from worker import protocol

from . import deploy
from .config import Config
from .transport import HostError, Transport


@dataclass
class ExportResult:
    summaries: dict[str, protocol.ExportSummary] = field(default_factory=dict)   # host -> worker.export's
    failed: dict[str, str] = field(default_factory=dict)       # host -> why its export stopped
    unreachable: dict[str, str] = field(default_factory=dict)  # host -> why it was not reached


async def export_fleet(config: Config, transports: dict[str, Transport], fmt: str, out: str
                       ) -> ExportResult:
    if config.spec.job is not None:
        raise HostError("export converts the built-in worker's output; this run uses a custom [job]")
    result = ExportResult()

    async def one(host) -> None:
        t = transports[host.name]
        try:
            await t.connect()
            await deploy.upload_worker(t, config, host)
        except HostError as e:
            result.unreachable[host.name] = str(e)
            return
        try:
            result.summaries[host.name] = await deploy.run_worker_module(
                t, config, host, "export", config.output_dir(host),
                "--format", fmt, "--out", config.host_path(host, out), reply=protocol.ExportSummary, timeout=None)
        except HostError as e:
            result.failed[host.name] = str(e)
    await asyncio.gather(*(one(h) for h in config.hosts))
    return result
