"""The output's footprint before it bites: what each host's shards will write against its free disk.

Preflight (worker/preflight.py `footprint`) projects every row's bytes from the dataset's real
lengths where that is cheap, and reports what is still to write in buckets of rows. A host writes
the rows of its shards (contiguous ranges, worker.ranges.shard_range), so its need is the sum of
those rows' buckets (a bucket cut by a shard boundary counts pro rata). Hosts whose output is one
folder (the same meta.json folder_id: a shared file system, known once the folder holds a
meta.json) draw on one free space together. Pure functions; `fleet up` prints them and refuses a
host that cannot hold its shards unless `--allow-partial`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.protocol import Footprint, PreflightReport
from worker.ranges import shard_range
from worker.text import ranges_text

from .units import bytes_text

WARN_FRACTION = 0.8              # a need above this share of the free space is worth a warning


def bytes_in(fp: Footprint, start: int, stop: int) -> float:
    """Bytes still to write for rows [start, stop) by the footprint's buckets (pro rata in a cut one)."""
    edges, remaining = fp.edges, fp.remaining
    total = 0.0
    for j, need in enumerate(remaining):
        lo, hi = edges[j], edges[j + 1]
        overlap = min(hi, stop) - max(lo, start)
        if overlap > 0 and hi > lo:
            total += need * overlap / (hi - lo)
    return total


@dataclass
class Need:
    """What one output folder (one host's, or one shared by several) still has to hold."""
    hosts: list[str]
    path: str
    shards: list[int] = field(default_factory=list)
    need: int = 0                # bytes still to write for these shards
    free: int | None = None      # bytes free at the output (the least any of the hosts reports)
    fp8_need: int | None = None  # the same in fp8, when the run is bf16 in a format that reads fp8
    total: int = 0               # what these shards write in all (`need` is what stays here at most)

    @property
    def fits(self) -> bool:
        return self.free is None or self.need <= self.free

    @property
    def name(self) -> str:
        return ", ".join(self.hosts)


def needs(reports: dict[str, PreflightReport], outputs: dict[str, str], shards_by_host: dict[str, list[int]],
          num_shards: int, keep_local: int | None = None) -> list[Need]:
    """One Need per output folder, from each host's preflight report (hosts without a footprint,
    such as a custom [job], are left out). With `keep_local` (a destination takes the files as
    they are written) a folder holds at most that much for each of its hosts."""
    groups: dict[str, Need] = {}
    for host, report in reports.items():
        fp = report.footprint
        if not fp or host not in shards_by_host:
            continue
        key = report.folder_id or f"host:{host}"
        group = groups.get(key)
        if group is None:
            group = groups[key] = Need([], outputs.get(host, "?"))
        group.hosts.append(host)
        free = report.free_bytes
        if free is not None:
            group.free = free if group.free is None else min(group.free, free)
        for k in shards_by_host[host]:
            group.shards.append(k)
            need = bytes_in(fp, *shard_range(fp.rows, num_shards, k))
            group.need += round(need)
            if fp.bytes_per_token_fp8:
                ratio = fp.bytes_per_token_fp8 / fp.bytes_per_token
                group.fp8_need = (group.fp8_need or 0) + round(need * ratio)
    for group in groups.values():
        group.total = group.need
        if keep_local is not None:
            group.need = min(group.need, keep_local * len(group.hosts))
            group.fp8_need = None if group.fp8_need is None else min(group.fp8_need, group.need)
    return list(groups.values())


def gb(n: float) -> str:
    """Bytes as a person reads them, to two decimals: 12.41 TB, 3.20 GB, 5.04 MB, 800 B."""
    return bytes_text(n, 2)


def describe(fp: Footprint) -> str:
    """The whole run's projection in one line, saying how it was counted."""
    per_element = "1 byte + a float32 scale per token per layer" if fp.dtype == "fp8" else "2 bytes"
    line = (f"output: {gb(fp.total_bytes)} for the whole run in {fp.dtype}: {fp.rows:,} rows, "
            f"{fp.tokens:,} tokens ({fp.basis}) x {fp.layers} layers x {fp.hidden_size} x "
            f"{per_element}")
    if fp.written_bytes:
        line += f"; {gb(fp.written_bytes)} already written"
    return line


def verdicts(groups: list[Need], allow_partial: bool) -> tuple[list[str], list[str]]:
    """(refusals, warnings), one line each, naming the hosts, the folder and the way out."""
    refusals, warnings = [], []
    for g in groups:
        if g.free is None:
            continue
        if not g.fits:
            cheaper = (f"; dtype = \"fp8\" needs about {gb(g.fp8_need)}" if g.fp8_need else "")
            line = (f"{g.name}: output {g.path} needs {gb(g.need)} more for shard(s) "
                    f"{ranges_text(g.shards)}, {gb(g.free)} free{cheaper}")
            if allow_partial:
                warnings.append(line + f" (--allow-partial: it stops when the disk is full, "
                                       f"after about {g.free / g.need:.0%} of it)")
            else:
                refusals.append(line + "; `fleet up --allow-partial` runs until the disk is full")
        elif g.need > WARN_FRACTION * g.free:
            warnings.append(f"{g.name}: output {g.path} needs {gb(g.need)} more of {gb(g.free)} free")
    return refusals, warnings


def outpaced(fp: Footprint, groups: list[Need], tokens_per_s_per_gpu: float | None,
             rates: dict[str, float | None]) -> list[tuple[str, int, float, float]]:
    """(host, its GPUs, the bytes/s they write at the expected rate, `rates`' figure) of each host
    whose GPUs would write faster than its measured rate: there that, not the GPU, sets the pace."""
    gpus_of = {h: len(g.shards) // max(1, len(g.hosts)) for g in groups for h in g.hosts}
    slow = []
    for host, rate in sorted((h, r) for h, r in rates.items() if r):
        gpus = gpus_of.get(host)
        if tokens_per_s_per_gpu and gpus and (needed := tokens_per_s_per_gpu * gpus * fp.bytes_per_token) > rate:
            slow.append((host, gpus, needed, rate))
    return slow


def _writes(host: str, gpus: int, needed: float, tokens_per_s_per_gpu: float) -> str:
    return f"{host}: its {gpus} GPU(s) write {gb(needed)}/s at the expected {tokens_per_s_per_gpu:,.0f} tokens/s a GPU"


def shipping_lines(fp: Footprint, destination: str, keep_local: int | None, groups: list[Need],
                   tokens_per_s_per_gpu: float | None, uplinks: dict[str, float | None]) -> tuple[str, list[str]]:
    """(the line: where the output goes, what each host keeps at its peak, each host's measured
    upload; the warnings: each host whose GPUs will write faster, at the expected rate, than its
    upload to the destination — there the uplink, not the GPU, sets the pace)."""
    peak = max((g.need for g in groups), default=0)
    line = f"output: ships to {destination} as it is written"
    line += (f"; each host keeps at most {gb(keep_local)} (peak here {gb(peak)})" if keep_local is not None
             else "; no keep_local: a host may hold all it writes until it is shipped")
    measured = {h: r for h, r in uplinks.items() if r}
    if measured:
        line += "; upload measured: " + ", ".join(f"{h} {gb(r)}/s" for h, r in sorted(measured.items()))
    cheaper = '; dtype = "fp8" halves the bytes' if fp.bytes_per_token_fp8 else ""
    if not tokens_per_s_per_gpu:                  # no expected rate: nothing can be outpaced
        return line, []
    warnings = [f"{_writes(host, gpus, needed, tokens_per_s_per_gpu)}, its upload to {destination} measured "
                f"{gb(rate)}/s: the uplink, not the GPU, sets the pace (about {rate / needed:.0%} of expected "
                f"once keep_local is full){cheaper}"
                for host, gpus, needed, rate in outpaced(fp, groups, tokens_per_s_per_gpu, uplinks)]
    return line, warnings


def disk_warnings(fp: Footprint, groups: list[Need], tokens_per_s_per_gpu: float | None,
                  write_rates: dict[str, float | None]) -> list[str]:
    """Each host whose GPUs will write faster, at the expected rate, than its output disks took
    files at preflight (worker.probe.write_rate) — the disk, not the GPU, would set the pace — with
    the ways out: fp8, another disk, fewer layers."""
    fixes = ('dtype = "fp8" halves the bytes; ' if fp.bytes_per_token_fp8 else "") + \
        "another disk in [run] output = [...] adds its rate; fewer layers write fewer bytes"
    if not tokens_per_s_per_gpu:                  # no expected rate: nothing can be outpaced
        return []
    return [f"{_writes(host, gpus, needed, tokens_per_s_per_gpu)}, its output disk(s) took {gb(rate)}/s at "
            f"preflight: the disk, not the GPU, sets the pace (about {rate / needed:.0%} of expected); {fixes}"
            for host, gpus, needed, rate in outpaced(fp, groups, tokens_per_s_per_gpu, write_rates)]
