"""`fleet verify`: every global index present exactly once across the fleet, every file sound.

Each host checks its own output folder (`python -m worker.verify`); this module merges the reports.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from worker import protocol
from worker.ranges import expand, shard_of, to_runs
from worker.text import runs_text

from . import deploy
from .config import Config, HostSpec
from .jobs import shard_dir
from .transport import HostError, Transport


@dataclass
class VerifyResult:
    num_samples: int | None = None
    format: str | None = None            # the trainer layout every host wrote (meta.json)
    dtype: str | None = None             # bf16 | fp8, as every host stored the hidden states
    written: int = 0
    skipped: dict[int, str] = field(default_factory=dict)
    missing: list[list[int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    unrecorded_files: int = 0
    repaired: dict[str, protocol.Repair] = field(default_factory=dict)   # host -> what --repair did there
    shared: dict[str, str] = field(default_factory=dict)      # host -> the host whose folder it shares
    commands: dict[str, str] = field(default_factory=dict)    # host -> the command that trains on its folder
    notes: list[str] = field(default_factory=list)            # what the trainer would miss, not wrong
    copies: int = 0                # rows with a second copy a trainer would read: another host's, or moved away
    checked_rows: int = 0                                     # rows the reference forward re-computed
    layer_ids: list[int] = field(default_factory=list)
    worst_cosine: list[float] = field(default_factory=list)   # per saved layer, over every host's checks

    @property
    def skip_fraction(self) -> float | None:
        return len(self.skipped) / self.num_samples if self.num_samples else None

    @property
    def ok(self) -> bool:
        return not self.problems and not self.missing and self.num_samples is not None


def merge_reports(reports: dict[str, protocol.VerifyReport]) -> VerifyResult:
    """The fleet's result from each host's report: a folder that hosts share counted once, what
    every host must agree on, every index held by one host only, and the runs no host holds."""
    result = VerifyResult()
    owner: dict[int, str] = {}                     # index -> the host that holds it
    distinct = _distinct_folders(reports, result.shared)
    for host, rep in distinct:
        _check_agreement(result, host, rep)
        _add_report(result, owner, host, rep)
    _add_moved(result, owner, distinct)
    if result.num_samples is None:
        there = result.written + len(result.skipped) + result.unrecorded_files
        result.problems.append(
            f"no meta.json on any host, though {result.written} sample file(s), {len(result.skipped)} skip(s) "
            f"and {result.unrecorded_files} unrecorded file(s) are there: their meta.json (format, layers, "
            f"dtype) was lost; restore it from a copy, or redo the run into a new output" if there else
            "no meta.json on any host: nothing has been extracted yet")
        return result
    out_of_range = [i for i in owner if not 0 <= i < result.num_samples]
    if out_of_range:
        result.problems.append(f"sample {out_of_range[0]}: index beyond the dataset's {result.num_samples} rows")
    result.missing = to_runs(i for i in range(result.num_samples) if i not in owner)
    return result


def _distinct_folders(reports: dict[str, protocol.VerifyReport],
                      shared: dict[str, str]) -> list[tuple[str, protocol.VerifyReport]]:
    """Each output folder's report once: a host whose folder another host already reported (one
    folder on NFS, the same folder_id) is recorded in `shared` instead of counted twice."""
    first: dict[str, str] = {}                     # folder_id -> the first host that reported it
    distinct = []
    for host, rep in reports.items():
        folder = rep.folder_id
        if folder and folder in first:
            shared[host] = first[folder]
            continue
        if folder:
            first[folder] = host
        distinct.append((host, rep))
    return distinct


# What every host's meta.json must agree on: the field, and the problem when two hosts differ.
_AGREED = (("num_samples", "{host}: meta.json says {new} samples, another host {old}"),
           ("format", "{host}: files in format {new}, another host's in {old}"),
           ("dtype", "{host}: hidden states in {new}, another host's in {old}"))


def _check_agreement(result: VerifyResult, host: str, rep: protocol.VerifyReport) -> None:
    """The sample count, format and dtype a host reports, taken into the result; one that differs
    from another host's is a problem."""
    for name, message in _AGREED:
        new, old = getattr(rep, name), getattr(result, name)
        if new is None:
            continue
        if old is not None and old != new:
            result.problems.append(message.format(host=host, new=new, old=old))
        setattr(result, name, new)


def _add_report(result: VerifyResult, owner: dict[int, str], host: str, rep: protocol.VerifyReport) -> None:
    """One host's problems, notes, command, repair and counts added to the result, and its indices
    (written or skipped) to `owner`: an index another host holds too is a problem."""
    result.problems += [f"{host}: {p}" for p in rep.problems]
    if rep.command and (rep.written or rep.skipped):          # a folder of rows that count
        result.commands[host] = rep.command
    result.notes += [f"{host}: {n}" for n in rep.notes]
    if rep.repaired:
        result.repaired[host] = rep.repaired
    result.unrecorded_files += rep.unrecorded_files
    for i in list(expand(rep.written)) + [int(i) for i in rep.skipped]:
        if i in owner:
            result.problems.append(f"sample {i}: present on {owner[i]} and on {host}")
            result.copies += 1
        owner[i] = host
    result.written += sum(b - a for a, b in rep.written)
    result.skipped.update({int(i): why for i, why in rep.skipped.items()})
    result.checked_rows += rep.checked_rows
    result.layer_ids = result.layer_ids or list(rep.layer_ids)
    if rep.worst_cosine:
        result.worst_cosine = [min(a, b) for a, b in zip(result.worst_cosine, rep.worst_cosine)] \
            if result.worst_cosine else list(rep.worst_cosine)


@dataclass
class MovedCopies:
    """What fleet verify makes of the copies that hosts' ledgers say moved to another host
    (`moved_copies`), per host: `extra` (another host holds the row whole, so this copy is a second
    one: --repair removes it), `counted` (nobody else holds it whole and this is the copy that
    counts), `restore` (the ledger gave the row to a host that never took it — one the run does not
    have, or this one — so --repair lifts that line and the row is this host's again)."""
    extra: dict[str, set[int]] = field(default_factory=dict)
    counted: dict[str, set[int]] = field(default_factory=dict)
    restore: dict[str, set[int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def moved_copies(reports: dict[str, protocol.VerifyReport]) -> MovedCopies:
    """The one rule for copies of moved rows: a claim that a row lives elsewhere is checked where it
    is said to live, and a copy is removed only where another is whole; of several copies nobody
    else holds, one counts (the first whole one, by host name)."""
    held = {h: set(expand(r.written)) - set(expand(r.broken)) for h, r in reports.items()}
    away = {h: _moved_rows(r) for h, r in reports.items()}
    whole_away = {h: set(rows) - set(expand(reports[h].broken)) for h, rows in away.items()}
    owner = _counting_copies(whole_away, held)
    out = MovedCopies({h: set() for h in reports}, {h: set() for h in reports}, {h: set() for h in reports})
    for h in sorted(reports):
        out.extra[h] |= _strays_held_elsewhere(h, reports[h], held)
        for i, to in sorted(away[h].items()):
            elsewhere = _held_whole(i, held)
            if elsewhere or owner.get(i, h) != h:
                out.extra[h].add(i)
            elif i in whole_away[h]:
                out.counted[h].add(i)
            if not elsewhere and _never_taken(h, to, reports):
                out.restore[h].add(i)
        out.problems += _kept_moves(h, away[h], out.counted[h], out.restore[h], reports)
    return out


def _moved_rows(report: protocol.VerifyReport) -> dict[int, str]:
    """row -> the host a host's ledger says it moved to, for every copy of it there."""
    return {i: to for to, runs in report.away.items() for i in expand(runs)}


def _held_whole(i: int, held: dict[str, set[int]]) -> bool:
    """Whether some host's folder holds row `i` whole as its own (not as a copy of a moved row)."""
    return any(i in rows for rows in held.values())


def _counting_copies(whole_away: dict[str, set[int]], held: dict[str, set[int]]) -> dict[int, str]:
    """row -> the host whose whole copy of it counts, for the moved rows no host holds as its own:
    the first such copy by host name."""
    owner: dict[int, str] = {}
    for h in sorted(whole_away):
        for i in sorted(whole_away[h]):
            if not _held_whole(i, held):
                owner.setdefault(i, h)
    return owner


def _strays_held_elsewhere(h: str, report: protocol.VerifyReport, held: dict[str, set[int]]) -> set[int]:
    """Files on `h` no manifest records, of moved rows another host holds whole: extra copies."""
    return {i for i in expand(report.strays) if any(i in rows for other, rows in held.items() if other != h)}


def _never_taken(h: str, to: str, reports: dict[str, protocol.VerifyReport]) -> bool:
    """Whether a ledger line on `h` gave rows to a host that cannot have taken them: one the run
    does not have (or that could not be read), or `h` itself."""
    return to not in reports or to == h


def _kept_moves(h: str, away: dict[int, str], counted: set[int], restore: set[int],
                reports: dict[str, protocol.VerifyReport]) -> list[str]:
    """One problem per host that `h`'s ledger says rows moved to while their copy on `h` is kept
    (it counts, or no copy is whole and the ledger line is lifted)."""
    kept = counted | restore
    problems = []
    for to in sorted({to for i, to in away.items() if i in kept}):
        rows = sorted(i for i, t in away.items() if t == to and i in kept)
        keeps = "this copy counts" if set(rows) & counted else "no copy is whole"
        problems.append(f"{h}: {len(rows)} sample(s) here ({runs_text(to_runs(rows))}) are marked moved to "
                        f"{_taker_words(h, to, reports)}: {keeps}; --repair keeps it"
                        + (" and lifts that ledger line" if set(rows) & restore else ""))
    return problems


def _taker_words(h: str, to: str, reports: dict[str, protocol.VerifyReport]) -> str:
    """How a problem names the host rows were marked moved to, and why its copy does not count."""
    if to == h:
        return "this host itself"
    if to in reports:
        return f"{to}, which holds none of them whole"
    return f"{to}, which is not a host of the run (or could not be read)"


def _add_moved(result: VerifyResult, owner: dict[int, str], reports: list[tuple[str, protocol.VerifyReport]]) -> None:
    """The copies of moved rows counted as `moved_copies` says: a second copy (a trainer would read
    it too: `copies`), or the row's own."""
    moved = moved_copies(dict(reports))
    result.problems += moved.problems
    for host, rows in moved.extra.items():
        result.copies += len(rows)
    for host, rows in moved.counted.items():
        for i in rows:
            owner[i] = host
            result.written += 1


async def verify_fleet(config: Config, transports: dict[str, Transport], deep: bool = True,
                       repair: bool = False) -> tuple[VerifyResult, dict[str, str]]:
    """Run the per-host check everywhere in parallel; (merged result, unreachable hosts)."""
    if config.spec.job is not None:
        raise HostError("verify checks the built-in worker's output; this run uses a custom [job]")

    async def one(host: HostSpec, *where: str, repair: bool = repair, confirmed: set[int] | None = None,
                  restore: set[int] | None = None) -> protocol.VerifyReport:
        t = transports[host.name]
        await t.connect()
        await deploy.upload_worker(t, config, host)      # a newer fleet's checks, not the old ones
        args = list(where) + ([] if deep else ["--shallow"]) + (["--repair"] if repair else []) + \
            (["--confirmed", runs_text(to_runs(confirmed))] if repair and confirmed else []) + \
            (["--restore", runs_text(to_runs(restore))] if repair and restore else [])
        return await deploy.run_worker_module(t, config, host, "verify", *args, reply=protocol.VerifyReport,
                                              timeout=None, env=config.run.env)

    async def each(hosts: list[HostSpec], where: Callable[[HostSpec], list[str]],
                   repair: bool = repair) -> tuple[dict[str, protocol.VerifyReport], dict[str, str]]:
        """host name -> its report, and host name -> why it could not be asked. A repair first
        checks every host as it is, so that what moved is removed only where the other host is
        found to hold it whole (`confirmed_moves`)."""
        moved = MovedCopies()
        if repair:
            checked, _ = await each(hosts, where, repair=False)
            moved = moved_copies(checked)
        results = await asyncio.gather(*(one(h, *where(h), repair=repair, confirmed=moved.extra.get(h.name),
                                             restore=moved.restore.get(h.name)) for h in hosts),
                                       return_exceptions=True)
        reports: dict[str, protocol.VerifyReport] = {}
        failures: dict[str, str] = {}
        for host, r in zip(hosts, results):
            if isinstance(r, HostError):
                failures[host.name] = str(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                reports[host.name] = r
        return reports, failures

    if config.run.destination is None:
        reports, failures = await each(config.hosts, lambda h: ["--out", config.output_dir(h)])
        result = merge_reports(reports)
        owned_by(result, reports, config.run.name)
        return result, failures
    # With a destination the output is in one place: each host mends its own part there first
    # (--repair: its manifests are the ones its shards write), then the whole is checked once,
    # from the first host (its credentials, as the shards' own), named by the destination.
    def at(h: HostSpec) -> str:
        """[run] destination as `h` gives it to rclone (this run has one)."""
        where = config.destination(h)
        assert where is not None
        return where

    mended: dict[str, protocol.VerifyReport] = {}
    failures = {}
    if repair:
        mended, failures = await each(config.hosts, lambda h: ["--out", config.output_dir(h), "--destination", at(h)])
    reports, more = await each(config.hosts[:1], lambda h: ["--destination", at(h)], repair=False)
    failures.update(more)
    whole = {at(h): r for h in config.hosts[:1] if (r := reports.get(h.name))}
    result = merge_reports(whole)
    owned_by(result, whole, config.run.name)
    if result.num_samples is None and whole:             # the hosts keep theirs: it can be shipped again
        result.problems = [p for p in result.problems if not p.startswith("no meta.json on any host")] + [
            f"no meta.json at the destination {config.run.destination} (its folder lost?): `fleet verify --repair` "
            f"ships it again from the hosts, with their manifests, and marks what is missing there to redo"]
    result.repaired.update({host: r.repaired for host, r in mended.items() if r.repaired})
    result.problems += [f"{host}: {p}" for host, r in mended.items() for p in r.problems
                        if not p.startswith("sample ")]           # (the samples: in the check of the whole)
    return result, failures


def owned_by(result: VerifyResult, reports: dict[str, protocol.VerifyReport], run: str) -> None:
    """A folder or destination whose owner record names another run holds that run's files, not
    this one's: never OK (two runs given one destination, the second overwriting the first)."""
    for where, rep in reports.items():
        if rep.owner is not None and rep.owner != run:
            result.problems.append(f"{where}: belongs to run {rep.owner!r} (its .fleet/owner.json), not to run "
                                   f"{run!r}: another run wrote there, so what is there is not this run's")
        elif rep.owner is None and (rep.written or rep.skipped) and rep.folder_id and "://" in rep.folder_id:
            result.notes.append(f"{where}: no owner record (.fleet/owner.json) yet: the next launch ships it")


def skip_problem(result: VerifyResult, limit: float) -> None:
    """More rows skipped than the run allows is a problem, as it is for the shards themselves."""
    if result.skip_fraction is not None and result.skip_fraction > limit:
        result.problems.append(f"{len(result.skipped)} of {result.num_samples} rows skipped "
                               f"({result.skip_fraction:.2%} > max_skip_fraction {limit:g})")


async def reopen_repaired(sup, result: VerifyResult) -> list[str]:
    """What --repair did, and a `reopened` record on every shard that has samples to redo (files
    dropped here, and every index no manifest records: lines a DONE shard's manifest lost), so
    the next `fleet up` relaunches exactly those shards (their plan says which rows they own)."""
    lines: list[str] = []
    per_shard: dict[int, int] = {}
    await sup.read_once()
    plan = sup.plan
    dropped = {i for rep in result.repaired.values() for i in rep.dropped}
    if plan and result.num_samples:
        for i in expand(result.missing):
            if i in dropped:                     # missing because dropped just now: counted below
                continue
            k = shard_of(i, result.num_samples, plan.num_shards)
            per_shard[k] = per_shard.get(k, 0) + 1
    for host, rep in result.repaired.items():
        lines.append(f"{host}: repaired: dropped {len(rep.dropped)} broken or missing sample(s)"
                     f"{' ' + str(rep.dropped[:20]) if rep.dropped else ''}, removed "
                     f"{rep.removed_files} file(s), {len(rep.deduplicated)} duplicate entr(ies)"
                     + (f", {len(rep.moved_away)} copies of rows another host holds now" if rep.moved_away else "")
                     + (f", {len(rep.reshipped)} still whole on the host, to ship again {rep.reshipped[:20]}"
                        if rep.reshipped else ""))
        if plan and result.num_samples:
            for i in rep.dropped + rep.reshipped:
                k = shard_of(i, result.num_samples, plan.num_shards)
                per_shard[k] = per_shard.get(k, 0) + 1
    for k, n in sorted(per_shard.items()):
        place = sup.shards[k].placement
        link = sup.links[place.host]
        await deploy.run_worker_module(link.transport, sup.config, link.spec, "hostctl", "reopen",
                                       "--shard-dir", shard_dir(sup.config, link.spec, k),
                                       "--samples", str(n), "--reason", "dropped by fleet verify --repair",
                                       reply=protocol.Status)
        lines.append(f"shard {k}: {n} sample(s) to redo: `fleet up` (or `fleet restart {k}`) redoes them")
    return lines
