"""`fleet verify`: every global index present exactly once across the fleet, every file sound.

Each host checks its own output folder (`python -m worker.verify`); this module merges the reports.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from . import deploy
from .config import Config
from .transport import HostError, Transport


@dataclass
class VerifyResult:
    num_samples: int | None = None
    format: str | None = None            # the trainer layout every host wrote (meta.json)
    written: int = 0
    skipped: dict[int, str] = field(default_factory=dict)
    missing: list[list[int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unrecorded_files: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems and not self.missing and self.num_samples is not None


def _expand(ranges: list[list[int]]):
    for a, b in ranges:
        yield from range(a, b)


def merge_reports(reports: dict[str, dict]) -> VerifyResult:
    result = VerifyResult()
    owner: dict[int, str] = {}
    for host, rep in reports.items():
        n = rep.get("num_samples")
        if n is not None:
            if result.num_samples is not None and result.num_samples != n:
                result.problems.append(f"{host}: meta.json says {n} samples, another host {result.num_samples}")
            result.num_samples = n
        fmt = rep.get("format")
        if fmt is not None:
            if result.format is not None and result.format != fmt:
                result.problems.append(f"{host}: files in format {fmt}, another host's in {result.format}")
            result.format = fmt
        result.problems += [f"{host}: {p}" for p in rep.get("problems", [])]
        result.unrecorded_files += rep.get("unrecorded_files", 0)
        indices = list(_expand(rep.get("written", []))) + [int(i) for i in rep.get("skipped", {})]
        for i in indices:
            if i in owner:
                result.problems.append(f"sample {i}: present on {owner[i]} and on {host}")
            owner[i] = host
        result.written += sum(b - a for a, b in rep.get("written", []))
        result.skipped.update({int(i): why for i, why in rep.get("skipped", {}).items()})
    if result.num_samples is None:
        result.problems.append("no meta.json on any host: nothing has been extracted yet")
        return result
    out_of_range = [i for i in owner if not 0 <= i < result.num_samples]
    if out_of_range:
        result.problems.append(f"sample {out_of_range[0]}: index beyond the dataset's {result.num_samples} rows")
    missing, start = [], None
    for i in range(result.num_samples + 1):
        absent = i < result.num_samples and i not in owner
        if absent and start is None:
            start = i
        elif not absent and start is not None:
            missing.append([start, i])
            start = None
    result.missing = missing
    return result


async def verify_fleet(config: Config, transports: dict[str, Transport], deep: bool = True
                       ) -> tuple[VerifyResult, dict[str, str]]:
    """Run the per-host check everywhere in parallel; (merged result, unreachable hosts)."""
    if config.spec.job is not None:
        raise HostError("verify checks the built-in worker's output; this run uses a custom [job]")

    async def one(host):
        t = transports[host.name]
        await t.connect()
        await deploy.upload_worker(t, config, host)      # a newer fleet's checks, not the old ones
        args = ["--out", config.host_path(host, config.run.output)] + ([] if deep else ["--shallow"])
        return await deploy.run_worker_module(t, config, host, "verify", *args, timeout=None)
    results = await asyncio.gather(*(one(h) for h in config.hosts), return_exceptions=True)
    reports, failures = {}, {}
    for host, r in zip(config.hosts, results):
        if isinstance(r, HostError):
            failures[host.name] = str(r)
        elif isinstance(r, BaseException):
            raise r
        else:
            reports[host.name] = r
    return merge_reports(reports), failures
