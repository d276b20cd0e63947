"""`python -m worker.verify --out DIR`: check a host's output folder; one JSON object on stdout.

Every manifest entry's file exists where meta.json's format puts it, opens, has the declared keys,
shapes and metadata, and holds finite values; every index is recorded once. The supervisor merges hosts' reports and checks that every
global index 0..N-1 is present exactly once across the fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet, cast

from . import protocol
from .files import OWNER_PATH, fatal_notes, file_md5, folder_owner, manifest_entries, remove_sample, retryable
from .formats import FORMATS, FormatError, Layout
from .layers import LayerPlan
from .leases import gone_to, ledger_files, moved_away
from .ranges import to_runs
from .text import parse_runs_text, ranges_text

if TYPE_CHECKING:
    from .ship import Destination


def layout_of(meta: dict) -> Layout:
    """The layout meta.json describes (runs from before formats existed are speculators files;
    runs from before fp8 existed are bf16)."""
    from .fp8 import dtype_of_name
    ids = tuple(meta.get("layer_ids", ()))
    L = meta.get("num_layers", max(ids, default=0))
    plan = LayerPlan(ids, meta.get("last_layer_norm", "none"), L,
                     bool(meta.get("target_last_hidden_states", False)))
    try:
        dtype = dtype_of_name(meta.get("dtype"))
    except ValueError:
        dtype = "bf16"
    fmt = meta.get("format", "speculators")
    try:
        return Layout(fmt, plan, dtype)
    except FormatError:                    # files its trainer would misread (verify says so), or
        return Layout(fmt if fmt in FORMATS else "speculators", plan, dtype, strict=False)  # unreadable meta


def check_file(layout: Layout, out: str, rec: dict, hidden: int | None) -> str | None:
    index = rec["index"]
    path = layout.path(out, index)
    try:
        tensors, meta = layout.load(path)
    except FileNotFoundError:
        return f"sample {index}: {path} missing"
    except Exception as e:
        return f"sample {index}: {path} unreadable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    problem = layout.check(tensors, rec.get("tokens"), hidden)
    if problem:
        return f"sample {index}: {path}: {problem}"
    if isinstance(rec.get("stats"), list):
        from .stats import changed, stats_of_file
        if why := changed(rec["stats"], stats_of_file(layout, tensors), list(layout.plan.ids)):
            return f"sample {index}: {path}: {why}"
    if rec.get("md5") and (md5 := file_md5(path)) != rec["md5"]:
        return f"sample {index}: {path} has MD5 {md5}, {rec['md5']} written: its bytes changed after writing"
    if layout.format == "speculators" and meta.get("sample_index") != str(index):
        return f"sample {index}: metadata sample_index is {meta.get('sample_index')!r}"
    if layout.format == "speculators" and meta.get("dtype", "bfloat16") != layout.header()["dtype"]:
        return f"sample {index}: metadata dtype is {meta.get('dtype')!r}, meta.json says {layout.header()['dtype']}"
    return None


def verify(out: str, deep: bool = True, threads: int = 8, repair: bool = False) -> dict:
    """check_folder's report as the JSON object `python -m worker.verify` prints."""
    return check_folder(out, deep, threads, repair).to_dict()


def check_folder(out: str, deep: bool = True, threads: int = 8, repair: bool = False,
                 confirmed: AbstractSet[int] = frozenset(),
                 restore: AbstractSet[int] = frozenset()) -> protocol.VerifyReport:
    """The folder's report; with `repair`, manifest entries whose files are missing or broken are
    dropped (and the broken files removed), so the next launch of their shard redoes exactly those,
    and the copies here of rows this host's ledger says moved to another host are removed where
    `confirmed` says another host holds them whole (fleet verify checked it there): never the only
    copy of a row on the word of a ledger line alone. `restore`: rows the ledger says moved to a
    host that never took them (one the run does not have, or this one): that line is lifted, and
    the rows are this host's again (done where their copy here is whole, else redone)."""
    meta = _read_meta(out)
    layout = layout_of(meta)
    found = _read_manifests(out, meta.get("num_samples"))
    if deep and (found.written or found.away_recs):     # (a copy of a row that moved: whole, or not?)
        found.broken = _check_files(layout, out, found.written + [r for r in found.away_recs.values()
                                                                   if "skipped" not in r],
                                    meta.get("hidden_size"), threads)
    _odd_states(found, layout)
    found.problems += found.broken.values()
    report = protocol.VerifyReport(num_samples=meta.get("num_samples"), format=layout.format, dtype=layout.dtype,
                                   checked=len(found.written), folder_id=meta.get("folder_id"))
    report.broken = to_runs(found.broken)
    if repair:
        report.repaired = _repair(out, layout, found, confirmed, restore)
    unrecorded = _unrecorded(out, layout, found)
    if repair and (stray := _moved_strays(out, layout, unrecorded, found, confirmed)):
        report.repaired = report.repaired or protocol.Repair()
        report.repaired.removed_files += len(stray)
        unrecorded -= stray
    report.strays = to_runs(i for i in unrecorded if _gone(found, i))
    report.written = to_runs(r["index"] for r in found.written)
    report.skipped = {str(i): why for i, why in sorted(found.skipped.items())}
    report.unrecorded_files, report.problems = len(unrecorded), found.problems + away_problems(found.away)
    report.away = away_runs(found.away)
    report.owner = folder_owner(out)
    report.problems += ledger_problems(out, meta.get("num_samples"))
    from .trainers import trainer_problems, training_command      # issue 22: what trains on it
    more, report.notes = trainer_problems(out, meta)
    report.problems += more
    report.command = training_command(meta, os.path.abspath(out)) if meta else None
    _whole_truth(out, meta, found, report)
    return report


def _whole_truth(out: str, meta: dict, found: "_Findings", report: protocol.VerifyReport) -> None:
    """What a reader of this folder alone must know besides its files: a shard that stopped for
    good (its note in the output: its rows are not all done, and a failed check means what is
    there may be wrong), more rows skipped than the run allowed, and what the reference checks
    found (rows checked, the worst cosine of each layer)."""
    for shard, why in fatal_notes(out).items():
        report.problems.append(f"shard {shard} stopped for good: {why}")
    limit, n = meta.get("max_skip_fraction"), meta.get("num_samples")
    if limit is not None and n and len(found.skipped) > limit * n:
        report.problems.append(f"{len(found.skipped)} of {n} rows skipped ({len(found.skipped) / n:.2%} > "
                               f"max_skip_fraction {limit:g})")
    from .reference import CHECKS_DIR
    rows = 0
    worst: list[float] = []
    for rec in manifest_records_in(os.path.join(out, CHECKS_DIR)):
        cos = rec.get("cosine")
        if isinstance(cos, list):
            rows += 1
            worst = [min(a, b) for a, b in zip(worst, cos)] if worst else list(cos)
    report.checked_rows, report.worst_cosine = rows, worst
    report.layer_ids = list(meta.get("layer_ids", []))


def manifest_records_in(folder: str):
    """Every record of every JSON-lines file in `folder` (the checks' files)."""
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".jsonl"):
            yield from protocol.iter_jsonl(os.path.join(folder, name))


def check_destination(url: str, deep: bool = True, threads: int = 8, out: str | None = None,
                      repair: bool = False, confirmed: AbstractSet[int] = frozenset(),
                      restore: AbstractSet[int] = frozenset()) -> protocol.VerifyReport:
    """The run's destination ([run] destination) checked from here. Alone: the whole run there —
    a path as an output folder, every file opened; a store (s3://, sftp://) by its manifests, meta
    and ledgers read back, and its listing: every recorded file there with the size and (deep) the
    MD5 the writer recorded. With `out` (a host's output folder): that host's own manifests against
    the destination, and with `repair` what is wrong there mended (`_repair_at`)."""
    from .ship import ShipError, destination
    try:
        dest = destination(url)
    except ShipError as e:
        return protocol.VerifyReport(problems=[str(e)])
    if not dest.is_store and out is None:
        report = check_folder(dest.remote, deep, threads)
        report.folder_id = url
        return report
    with tempfile.TemporaryDirectory() as tmp:
        listing = _read_back(dest, url, deep, tmp if out is None else None)
        if isinstance(listing, protocol.VerifyReport):
            return listing
        return _landed(dest, url, tmp if out is None else out, listing, out, repair, confirmed, restore)


# Every file at a destination: relative path -> (bytes, MD5 where the store keeps one).
Listing = dict[str, tuple[int, str | None]]


def _read_back(dest: Destination, url: str, deep: bool, into: str | None) -> Listing | protocol.VerifyReport:
    """The destination's listing, and with `into` its meta, manifests, ledgers and owner record
    copied there (a check of the whole run); where it cannot be read, the report that says so."""
    from .ship import ShipError, rclone
    try:
        if into is not None:
            got = rclone(dest, "copy", dest.remote, into, "--include", f"/{protocol.META_FILE}",
                         "--include", f"/{protocol.MANIFEST_DIR}/*.jsonl", "--include", "/.fleet/leases-*.json",
                         "--include", f"/{OWNER_PATH}", timeout=600)
            if got.returncode != 0:
                return _unreachable(url, got)
        listing = _listing(dest, deep)
    except (ShipError, OSError, subprocess.TimeoutExpired) as e:
        return protocol.VerifyReport(folder_id=url, problems=[f"destination {url}: {e}"])
    if isinstance(listing, subprocess.CompletedProcess):
        return _unreachable(url, listing)
    return listing


def _landed(dest: Destination, url: str, here: str, listing: Listing, out: str | None, repair: bool,
            confirmed: AbstractSet[int], restore: AbstractSet[int]) -> protocol.VerifyReport:
    """The report on what landed at the destination, read by the records in `here` (the whole
    run's, read back; or a host's own folder `out`, its part mended with `repair`)."""
    meta = _read_meta(here)
    layout = layout_of(meta)
    found = _read_manifests(here, meta.get("num_samples"))
    found.broken = _landed_wrong(layout, here, found.written, listing, url)
    _odd_states(found, layout)
    report = protocol.VerifyReport(num_samples=meta.get("num_samples"), format=layout.format, dtype=layout.dtype,
                                   checked=len(found.written), folder_id=url)
    report.broken = to_runs(found.broken)
    if out is not None:
        _hosts_part(report, dest, out, layout, found, repair, confirmed, restore)
    found.problems += found.broken.values()
    found.problems += away_problems(found.away)
    report.away = away_runs(found.away)
    report.written = to_runs(r["index"] for r in found.written)
    report.skipped = {str(i): why for i, why in sorted(found.skipped.items())}
    report.problems = found.problems
    if out is None:
        _whole_run(report, dest, url, here, meta, layout, found, listing)
    return report


def _hosts_part(report: protocol.VerifyReport, dest: Destination, out: str, layout: Layout, found: "_Findings",
                repair: bool, confirmed: AbstractSet[int], restore: AbstractSet[int]) -> None:
    """A host's part of the destination: mended with `repair` (`_repair_at`), and the files in its
    folder no manifest records, of rows that moved away (`strays`)."""
    if repair:
        report.repaired = _repair_at(dest, out, layout, found, confirmed, restore)
    unrecorded = _unrecorded(out, layout, found)
    report.strays = to_runs(i for i in unrecorded if _gone(found, i))


def _whole_run(report: protocol.VerifyReport, dest: Destination, url: str, here: str, meta: dict,
               layout: Layout, found: "_Findings", listing: Listing) -> None:
    """What a check of the whole run at the destination adds: its owner record, the sample files
    there no manifest records, and the trainer's command on a local copy (and how to make one)."""
    from .ship import download_hint
    from .trainers import training_command
    report.owner = folder_owner(here)
    recorded = {os.path.relpath(layout.path(here, r["index"]), here) for r in found.written}
    samples = {p for p in listing if os.path.basename(p).startswith(protocol.SAMPLE_PREFIX)}
    report.unrecorded_files = len(samples - recorded)
    report.command = training_command(meta, "DIR") if meta else None
    if dest.is_store:
        speculators = layout.format == "speculators"
        report.notes = ["the trainer reads a local folder DIR: `fleet download DIR` copies it there"
                        + (" with speculators' prepared/ index" if speculators else "")
                        + f" (or `{download_hint(url)}`"
                        + (", then `python -m worker.prepared DIR`" if speculators else "")
                        + ")"]


def _odd_states(found: "_Findings", layout: Layout) -> None:
    """The written samples whose recorded statistics no real model makes (stats.anomalies: a layer
    all zero or constant, two layers alike, a sample the same as another with other tokens, an RMS
    far outside the run's): broken, so verify fails and --repair has them redone."""
    from .stats import anomalies
    for i, why in anomalies(found.written, list(layout.plan.ids)).items():
        found.broken.setdefault(i, f"sample {i}: {why}")


def _unreachable(url: str, failed: subprocess.CompletedProcess) -> protocol.VerifyReport:
    from .ship import rclone_error
    return protocol.VerifyReport(folder_id=url, problems=[
        f"destination {url}: {rclone_error(failed.stderr or failed.stdout)}"])


def _listing(dest: Destination, deep: bool) -> Listing | subprocess.CompletedProcess:
    """Every file at the destination: relative path -> (bytes, MD5 when `deep` and the store
    keeps one); rclone's failed call where it could not list."""
    from .ship import rclone
    listed = rclone(dest, "lsjson", "-R", "--files-only", "--no-mimetype", "--no-modtime",
                    *(("--hash", "--hash-type", "md5") if deep else ()), dest.remote, timeout=3600)
    if listed.returncode != 0:
        return listed
    return {e["Path"]: (e["Size"], (e.get("Hashes") or {}).get("md5") or None)
            for e in json.loads(listed.stdout or "[]")}


def _landed_wrong(layout: Layout, here: str, written: list[dict], listing: Listing, url: str) -> dict[int, str]:
    """index -> what is wrong with its copy at the destination: missing, or not the size or MD5
    its writer recorded (a store that keeps no MD5 for a file is checked by size)."""
    wrong = {}
    for rec in written:
        rel = os.path.relpath(layout.path(here, rec["index"]), here)
        where = f"sample {rec['index']}: {url.rstrip('/')}/{rel}"
        size, md5 = listing.get(rel, (None, None))
        if size is None:
            wrong[rec["index"]] = f"{where} missing at the destination"
        elif rec.get("bytes") is not None and size != rec["bytes"]:
            wrong[rec["index"]] = f"{where} holds {size} bytes, {rec['bytes']} written"
        elif md5 and rec.get("md5") and md5 != rec["md5"]:
            wrong[rec["index"]] = f"{where} has MD5 {md5}, {rec['md5']} written: its bytes changed after writing"
    return wrong


def _repair_at(dest: Destination, out: str, layout: Layout, found: "_Findings", confirmed: AbstractSet[int],
               restore: AbstractSet[int]) -> protocol.Repair | None:
    """Mend this host's part of the destination: a sample whose copy there is missing or wrong is
    shipped again by the next launch where its file is still here and whole (its wrong copy
    removed); else its manifest entry is dropped (and the copy there removed), so the next launch
    of its shard redoes it; files here of rows that moved away go (`_moved_strays`). The manifests
    are then copied there, so the destination's agree."""
    from .ship import rclone
    reship = {i for i in found.broken if _whole_here(layout, out, i, found.written)}
    for i in sorted(found.broken):
        rel = os.path.relpath(layout.path(out, i), out)
        rclone(dest, "deletefile", dest.under(rel), timeout=600)    # absent already: nothing to do
    kept = {i: why for i, why in found.broken.items() if i in reship}
    found.broken = {i: why for i, why in found.broken.items() if i not in reship}
    repaired = _repair(out, layout, found, confirmed, restore) or protocol.Repair()
    repaired.reshipped = sorted(reship)
    unrecorded = _unrecorded(out, layout, found)
    repaired.removed_files += len(_moved_strays(out, layout, unrecorded, found, confirmed))
    found.broken = kept                       # still missing there until the next launch ships them
    folder = os.path.join(out, protocol.MANIFEST_DIR)
    records = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".jsonl")]
    records += ledger_files(out) + [os.path.join(out, protocol.META_FILE), os.path.join(out, OWNER_PATH)]
    for path in records:             # (the ledgers: which rows moved away; meta and owner: a lost folder's)
        if os.path.exists(path):
            rclone(dest, "copyto", path, dest.under(os.path.relpath(path, out)), timeout=600)
    return repaired if repaired != protocol.Repair() else None


def _whole_here(layout: Layout, out: str, index: int, written: list[dict]) -> bool:
    """Whether sample `index`'s file is still in this host's folder with the MD5 (or, with none
    recorded, the size) its writer recorded."""
    path = layout.path(out, index)
    rec = next(r for r in written if r["index"] == index)
    try:
        return file_md5(path) == rec["md5"] if rec.get("md5") else os.path.getsize(path) == rec.get("bytes")
    except OSError:
        return False


@dataclass
class _Findings:
    """What a folder's manifests and files say: its entries (written, skipped), the indices recorded
    twice, the broken files and every problem, in the order the report lists them."""
    written: list[dict]
    skipped: dict[int, str]
    twice: set[int]
    problems: list[str]
    broken: dict[int, str] = field(default_factory=dict)
    away: dict[int, str] = field(default_factory=dict)       # index -> the host its rows moved to
    away_recs: dict[int, dict] = field(default_factory=dict)  # index -> its entry here (its file checked too)
    gone: dict[str, list[list]] = field(default_factory=dict)  # manifest name -> its pool's moved rows
    outside: dict[int, str] = field(default_factory=dict)     # index outside the dataset -> its manifest


def _read_meta(out: str) -> dict:
    """The folder's meta.json; none (or unreadable) reads as {}, the oldest layout."""
    try:
        return json.load(open(os.path.join(out, protocol.META_FILE)))
    except (OSError, ValueError):
        return {}


def _read_manifests(out: str, num_samples: int | None = None) -> _Findings:
    """Every index's first manifest entry; a second one for the same index is a problem. An entry
    of rows that moved to another host (its copy is the one that counts) is set aside in `away`;
    one outside the dataset's rows (no run of this data wrote it) in `outside`."""
    seen: dict[int, dict] = {}
    twice: set[int] = set()
    problems: list[str] = []
    gone = moved_away(out)
    away: dict[int, str] = {}
    away_recs: dict[int, dict] = {}
    outside: dict[int, str] = {}
    for name, rec in manifest_entries(out):
        i = rec["index"]
        if num_samples is not None and not 0 <= i < num_samples:
            outside[i] = name
            problems.append(f"sample {i}: in {protocol.MANIFEST_DIR}/{name}, outside the dataset's {num_samples} rows")
            continue
        if (to := gone_to(gone, name, i)) is not None:
            away[i] = to
            away_recs.setdefault(i, rec)
            continue
        if i in seen:
            problems.append(f"sample {i}: recorded twice in the manifests")
            twice.add(i)
            continue
        seen[i] = rec
    written = [r for r in seen.values() if "skipped" not in r]
    skipped = {i: r["skipped"] for i, r in seen.items() if "skipped" in r}
    return _Findings(written, skipped, twice, problems, away=away, away_recs=away_recs, gone=gone, outside=outside)


def away_problems(away: dict[int, str]) -> list[str]:
    """One problem per host that this host's ledger says rows written here moved to (fleet verify
    checks the copy there: where it is whole, it counts and --repair removes these)."""
    out = []
    for to in sorted(set(away.values())):
        mine = [i for i, h in away.items() if h == to]
        out.append(f"{len(mine)} sample(s) here ({ranges_text(mine)}) moved to {to} while this host was lost or "
                   f"idle (its ledger says): the copy there counts where it is whole, and `fleet verify --repair` "
                   f"removes these then")
    return out


def away_runs(away: dict[int, str]) -> dict[str, list[list[int]]]:
    """host -> runs of the rows here this host's ledger says moved there."""
    return {to: to_runs(i for i, h in away.items() if h == to) for to in sorted(set(away.values()))}


def _check_files(layout: Layout, out: str, written: list[dict], hidden: int | None,
                 threads: int) -> dict[int, str]:
    """Each written entry's file opened and checked (check_file), in parallel: index -> problem of
    those that fail, in the manifests' order."""
    broken: dict[int, str] = {}
    with ThreadPoolExecutor(threads) as pool:
        for rec, problem in zip(written, pool.map(lambda r: check_file(layout, out, r, hidden), written)):
            if problem:
                broken[rec["index"]] = problem
    return broken


def _repair(out: str, layout: Layout, found: _Findings, confirmed: AbstractSet[int] = frozenset(),
            restore: AbstractSet[int] = frozenset()) -> protocol.Repair | None:
    """Drop the broken and twice-recorded entries, the retryable skips and the copies of rows that
    moved to another host whose copy there is `confirmed` (repair_folder); lift the ledger's lines
    for the `restore` rows (`restore_rows`); and take all that out of the findings: what is dropped
    is no longer a problem but work for the next launch; a move nobody confirmed stays, said."""
    if found.outside:              # not this run's lines: nothing is changed until a person looks
        _refuse_outside(found)
        return None
    retry = {i for i, why in found.skipped.items() if retryable(why)}
    moved = {i for i in found.away if i in confirmed}
    restored = {i for i in found.away if i in restore and i not in moved}
    if not (found.broken or found.twice or retry or moved or restored):
        return None
    if restored:
        restore_rows(out, found, restored)
    folder = os.path.join(out, protocol.MANIFEST_DIR)
    repaired = repair_folder(out, layout, found.broken, found.twice, folder, retry, found.gone, moved)
    _forget_repaired(found, retry, moved, restored)
    repaired.restored = sorted(restored)
    return repaired


def _refuse_outside(found: _Findings) -> None:
    """A manifest line of an index outside the dataset refuses the repair, said as a problem: no
    run of this data wrote it, so a person looks before anything is changed."""
    i, name = next(iter(found.outside.items()))
    found.problems.append(f"--repair refused: {protocol.MANIFEST_DIR}/{name} holds index {i}, outside the "
                          f"dataset: a line no run of this data wrote; remove it (or the manifest) first")


def _forget_repaired(found: _Findings, retry: set[int], moved: set[int], restored: set[int]) -> None:
    """The findings as the repair left the folder: the dropped entries' problems and the retried
    skips gone (work for the next launch), the restored rows this host's own again (written or
    skipped, as their entries here say), the moved and restored rows no longer away, and the broken
    entries no longer written."""
    dropped = set(found.broken) | found.twice
    found.skipped = {i: why for i, why in found.skipped.items() if i not in retry}
    found.problems = [p for p in found.problems if not any(p.startswith(f"sample {i}:") for i in dropped)]
    _take_back(found, restored)
    found.away = {i: to for i, to in found.away.items() if i not in moved | restored}   # (moved: the other copy counts)
    found.written = [r for r in found.written if r["index"] not in found.broken]


def _take_back(found: _Findings, restored: set[int]) -> None:
    """The restored rows' entries here counted as this host's: written (unless broken) or skipped."""
    records = {i: found.away_recs[i] for i in sorted(restored)}
    found.written += [rec for i, rec in records.items() if i not in found.broken and "skipped" not in rec]
    found.skipped.update({i: rec["skipped"] for i, rec in records.items() if "skipped" in rec})


def ledger_problems(out: str, num_samples: int | None) -> list[str]:
    """What a pool ledger here says that cannot be (Ledger.check), one line each: a launch would
    refuse it (FATAL), so verify says it first."""
    from .leases import Ledger
    out_problems = []
    for path in ledger_files(out):
        try:
            ledger = Ledger.from_json(open(path).read())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            out_problems.append(f"{path}: not a ledger ({type(e).__name__}); a launch refuses it: remove it")
            continue
        if (why := ledger.check(num_samples)) is not None:
            out_problems.append(f"{path}: {why}; a launch refuses it")
    return out_problems


def restore_rows(out: str, found: _Findings, rows: set[int]) -> None:
    """Lift the ledger lines that gave `rows` away to a host that never took them: the rows are the
    pool's again, free (a launch takes free rows and skips those its manifests record: a whole copy
    here is kept, a missing one redone)."""
    from .leases import Ledger, merge, open_ledger, subtract
    runs = [(a, b) for a, b in to_runs(rows)]
    for path in ledger_files(out):
        try:
            ranges = {int(k): cast("tuple[int, int]", tuple(v))    # (a plan's range: a start and a stop)
                      for k, v in Ledger.from_json(open(path).read()).ranges.items()}
        except (OSError, ValueError, KeyError, TypeError):
            continue
        with open_ledger(path, ranges, check=False) as ledger:
            kept, lifted = [], []
            for a, b, host in ledger.gone:
                kept += [[x, y, host] for x, y in subtract([(a, b)], runs)]
                lifted += [(max(a, x), min(b, y)) for x, y in runs if max(a, x) < min(b, y)]
            if lifted:                       # free again, but for rows another entry has (a line that lied)
                ledger.gone = kept
                have = [(l.start, l.stop) for l in ledger.held.values()] + [(a, b) for a, b, _ in ledger.done + ledger.free]
                ledger.free += [[a, b, None] for a, b in subtract(merge(lifted), merge(have))]
    for manifest, gone in found.gone.items():            # what this check still reads as moved
        found.gone[manifest] = [[a, b, h] for a0, b0, h in gone for a, b in subtract([(a0, b0)], runs)]


def _unrecorded(out: str, layout: Layout, found: "_Findings") -> set[int]:
    """The rows whose files lie in `out` while no manifest line of it records them."""
    return set(layout.scan(out)) - {r["index"] for r in found.written}


def _moved_strays(out: str, layout: Layout, unrecorded: set[int], found: _Findings,
                  confirmed: AbstractSet[int] = frozenset()) -> set[int]:
    """Files no manifest records, of rows that moved to another host that holds them whole
    (`confirmed`; a file written as the host was lost, before its manifest line): nobody here will
    ever finish them. Removed; returned."""
    stray = {i for i in unrecorded if i in confirmed and _gone(found, i)}
    for i in stray:
        remove_sample(layout.path(out, i))
    return stray


def _gone(found: _Findings, i: int) -> bool:
    """Whether row `i` is one this host's ledgers say moved to another host."""
    return any(a <= i < b for runs in found.gone.values() for a, b, _ in runs)


def repair_folder(out: str, layout: Layout, broken: dict[int, str], twice: set[int], folder: str,
                  retry: AbstractSet[int] = frozenset(), gone: dict[str, list[list]] | None = None,
                  away: AbstractSet[int] = frozenset()) -> protocol.Repair:
    """Rewrite each manifest without the broken entries, the retryable skips and the entries of
    rows that moved to another host that holds them (`away`, within the ledger's `gone`: manifest
    name -> its pool's moved rows), with one entry per index, atomically; remove the broken files
    and the moved rows' (unless another manifest still records one). What is dropped is redone by
    the next launch of its shard; what moved away is the other host's."""
    from .writer import write_lines_atomic
    kept: set[int] = set()
    gone = gone or {}
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".jsonl")):
        path = os.path.join(folder, name)
        lines = []
        for rec in protocol.iter_jsonl(path):
            i = rec.get("index")
            if isinstance(i, int):
                if i in broken or i in kept or (i in retry and "skipped" in rec) or \
                        (i in away and gone_to(gone, name, i) is not None):
                    continue
                kept.add(i)
            lines.append(json.dumps(rec, separators=(",", ":")))
        write_lines_atomic(path, lines)
    removed = sum(remove_sample(layout.path(out, i)) for i in sorted((set(away) - kept) | set(broken)))
    return protocol.Repair(dropped=sorted(set(broken) | set(retry)), deduplicated=sorted(twice),
                           removed_files=removed, retried_skips=sorted(retry), moved_away=sorted(away))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.verify")
    ap.add_argument("--out", help="an output folder on this host")
    ap.add_argument("--destination", help="the run's destination (s3://, sftp:// or a path); with --out, "
                                          "this host's manifests checked (and --repair'd) against it")
    ap.add_argument("--shallow", action="store_true", help="manifests only; do not open the files")
    ap.add_argument("--repair", action="store_true",
                    help="drop manifest entries whose files are missing or broken (and those files), "
                         "and the skips of failures that may pass (out of memory, a GPU error)")
    ap.add_argument("--confirmed", default="", help="with --repair: the rows (0-99,250-299) that moved to "
                    "another host and that fleet verify found whole there: their copies here go")
    ap.add_argument("--restore", default="", help="with --repair: the rows this host's ledger gave to a host "
                    "that never took them: they are this host's again")
    args = ap.parse_args(argv)
    if not (args.out or args.destination):
        ap.error("--out or --destination is required")
    if args.repair and args.destination and not args.out:
        ap.error("--repair at the destination mends a host's part of it: give its --out too")
    if args.repair and args.shallow:
        ap.error("--repair needs the files opened; drop --shallow")
    confirmed = {i for a, b in parse_runs_text(args.confirmed) for i in range(a, b)}
    restore = {i for a, b in parse_runs_text(args.restore) for i in range(a, b)}
    if args.destination:
        print(check_destination(args.destination, deep=not args.shallow, out=args.out, repair=args.repair,
                                confirmed=confirmed, restore=restore).to_json())
        return 0
    print(check_folder(args.out, deep=not args.shallow, repair=args.repair, confirmed=confirmed,
                       restore=restore).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
