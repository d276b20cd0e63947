"""Files both sides write and read the same way: one atomic writer, and the output's manifests.

Standard library only (it travels to every host and `fleet` imports it).

- `replace_atomically` / `write_atomic`: a file is whole or absent — written to a temp name
  (TEMP_PREFIX: no reader's listing picks it up), fsync'd, renamed into place. Every replaced file
  of the worker goes through it (sample files, meta.json, the plan, Slurm's submissions, pid files).
- `manifest_records`: every record of an output folder's manifests (`manifest/<shard>.jsonl`, one
  line per finished sample, written or skipped), in file order — what the extractor resumes from,
  preflight's footprint counts and verify checks.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from typing import IO, Callable, Iterator

from .protocol import MANIFEST_DIR, TEMP_PREFIX, iter_jsonl


def replace_atomically(path: str, write: Callable[[str], None], tmp: str | None = None,
                       sync: bool = True) -> None:
    """Write a file whole or not at all: `write(tmp)` fills a temp file, which is fsync'd (unless
    `sync` is False: a file that must outlive the process, not the host) and renamed to `path`; on
    any failure the temp file is removed and the error raised."""
    tmp = tmp or os.path.join(os.path.dirname(path) or ".",
                              f"{TEMP_PREFIX}{os.path.basename(path)}-{os.getpid()}")
    try:
        write(tmp)
        if sync:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_atomic(path: str, data: str | bytes, mode: int = 0o644, sync: bool = True) -> None:
    """Replace `path` with `data` (text or bytes), created with permissions `mode`."""
    raw = data.encode() if isinstance(data, str) else data

    def write(tmp: str) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
    replace_atomically(path, write, sync=sync)


def file_md5(path: str, chunk: int = 1 << 22) -> str:
    """The file's MD5, hex: what an S3 store's ETag, rclone's --checksum and `md5sum` all give, so
    a manifest's record of it can be compared with the destination's own."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


WORK_DIR = ".fleet"          # the writers' own files (owner, locks, ledgers); no reader lists it
OWNER_PATH = os.path.join(WORK_DIR, "owner.json")   # the run that owns a folder, or a destination


SHIPPING_LEFTOVERS = "shipping the files it left"   # a lock holder that is a mate shipping for it


def lock_shard(out_dir: str, shard: int | str) -> tuple[IO | None, str | None]:
    """Take `<out_dir>/.fleet/<shard>.lock` without waiting, the one lock of a shard's writer:
    (the open file: keep it while writing there, None) or (None, who holds it, as the holder
    wrote). A file system without locks gives the file: the run's own checks stand."""
    work = os.path.join(out_dir, WORK_DIR)
    os.makedirs(work, exist_ok=True)
    lock_path = os.path.join(work, f"{shard}.lock")
    lock = open(lock_path, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        return None, holder
    except OSError:
        pass
    return lock, None


def disk_of(index: int, roots: tuple[str, ...] | list[str]) -> str:
    """Which of an output's folders (the output folder first, then the other disks' of [run]
    output) holds sample `index`'s bytes: each in turn, so every disk takes an equal share."""
    return roots[index % len(roots)]


def link_atomically(target: str, path: str) -> None:
    """`path` becomes a symbolic link to `target` (an absolute path), replacing what was there."""
    tmp = os.path.join(os.path.dirname(path), f"{TEMP_PREFIX}link-{os.getpid()}-{os.path.basename(path)}")
    try:
        os.symlink(target, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def remove_sample(path: str) -> bool:
    """Remove a sample's file: where it is a link to another disk's copy, that copy too. Whether
    anything was there."""
    there = os.path.islink(path)
    if there:
        try:
            os.unlink(os.path.realpath(path))
        except FileNotFoundError:
            pass
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return there


def relation(path: str, other: str) -> str | None:
    """How folder `path` stands to folder `other`, links followed: "is", "is inside", "holds", or
    None (apart)."""
    a, b = os.path.realpath(path), os.path.realpath(other)
    if a == b:
        return "is"
    if a.startswith(b.rstrip(os.sep) + os.sep):
        return "is inside"
    if b.startswith(a.rstrip(os.sep) + os.sep):
        return "holds"
    return None


def folder_owner(folder: str) -> str | None:
    """The run a folder's owner record names (worker.writer.claim_output writes it: the first run
    to write there), if any."""
    try:
        with open(os.path.join(folder, OWNER_PATH)) as f:
            owner = json.load(f)
    except (OSError, ValueError):
        return None
    run = owner.get("run") if isinstance(owner, dict) else None
    return run if isinstance(run, str) else None


def run_outputs_near(path: str, depth: int = 2) -> list[tuple[str, str]]:
    """(folder, run) of every run's output folder at `path`, above it, or up to `depth` levels
    below it: each folder holding an owner file (`.fleet/owner.json`, the run that first wrote
    there) — what an output, an export or a destination must not be mixed into."""
    found: list[tuple[str, str]] = []

    def owner(folder: str) -> None:
        if (run := folder_owner(folder)) is not None:
            found.append((folder, run))
    here = os.path.realpath(path)
    up = here
    while True:
        owner(up)
        if os.path.dirname(up) == up:
            break
        up = os.path.dirname(up)
    level = [here]
    for _ in range(depth):
        below = []
        for folder in level:
            try:
                with os.scandir(folder) as entries:
                    below += [e.path for e in entries if e.is_dir(follow_symlinks=False) and e.name != WORK_DIR][:1000]
            except OSError:
                continue
        for folder in below:
            owner(folder)
        level = below
    return found


# Skip reasons of failures that may pass (worker.extract: a row that failed alone after the rest,
# or killed the process alone): `verify --repair` and a user's own launch of the shard drop them,
# so that launch (a bigger GPU, a smaller batch budget, a fixed driver) tries those rows again.
RETRYABLE = ("(alone, after the rest)", "the worker process died")


def retryable(reason: str) -> bool:
    return any(mark in reason for mark in RETRYABLE)


def retry_skips(out_dir: str, shard: int | str) -> list[int]:
    """Drop the retryable skips from shard `shard`'s own manifest (its writer's lock held), so
    this launch redoes those rows; the rows dropped."""
    path = manifest_path(out_dir, shard)
    if not os.path.exists(path):
        return []
    kept: list[str] = []
    dropped: list[int] = []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                kept.append(line)
                continue
            if isinstance(rec, dict) and isinstance(rec.get("skipped"), str) and retryable(rec["skipped"]):
                dropped.append(rec["index"])          # (every manifest record has its index)
            else:
                kept.append(line)
    if dropped:
        write_atomic(path, "".join(line if line.endswith("\n") else line + "\n" for line in kept))
    return dropped


def note_fatal(out_dir: str, shard: int | str, reason: str | None) -> None:
    """Say in the output itself that shard `shard` stopped for good and why (`.fleet/<shard>.fatal`),
    so a reader of the folder alone (verify) knows its rows are not all there and that what is
    there may be wrong; None: it has finished since, the note goes."""
    path = os.path.join(out_dir, WORK_DIR, f"{shard}.fatal")
    if reason is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_atomic(path, reason + "\n")


def fatal_notes(out_dir: str) -> dict[str, str]:
    """shard -> why it stopped for good, of every shard whose note is in the output."""
    folder = os.path.join(out_dir, WORK_DIR)
    out = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".fatal"):
            with contextlib.suppress(OSError):
                out[name[:-len(".fatal")]] = open(os.path.join(folder, name)).read().strip()
    return out


def manifest_path(out_dir: str, shard: int | str) -> str:
    return os.path.join(out_dir, MANIFEST_DIR, f"{shard}.jsonl")


def manifest_records(out_dir: str) -> Iterator[dict]:
    """Every manifest record with an integer `index`, manifest by manifest (sorted by name), each
    in file order; a torn or foreign line is passed over. A repeat of an index is yielded again
    (verify reports it)."""
    return (rec for _, rec in manifest_entries(out_dir))


def manifest_entries(out_dir: str) -> Iterator[tuple[str, dict]]:
    """`manifest_records`, each with the name of the manifest it is in (`<shard>.jsonl`)."""
    folder = os.path.join(out_dir, MANIFEST_DIR)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".jsonl"):
            for rec in iter_jsonl(os.path.join(folder, name)):
                if isinstance(rec.get("index"), int):
                    yield name, rec
