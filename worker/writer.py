"""Output side of the worker: atomic sample files, the shard manifest, a bounded background writer.

A sample is done only once its file is complete on disk (temp name, fsync, rename) and its line is
in the manifest. The GPU hands each batch over as one device->host copy on a side stream into a
reusable pinned buffer; the writer thread waits for that copy, checks each sample and writes it.
The GPU waits for the disk only when every buffer is in use, and that wait is measured.
With dtype fp8 the batch is quantised on the GPU first (worker/fp8.py), so the buffers, the copy
and the files all carry half the bytes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import queue
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import fp8, inject, protocol
from .files import OWNER_PATH, SHIPPING_LEFTOVERS, WORK_DIR, disk_of, file_md5, link_atomically, lock_shard, manifest_records, replace_atomically
from .files import manifest_path  # noqa: F401  (extract's)
from .formats import Layout
from .layers import LayerPlan
from .stats import batch_stats, rounded

SPECULATORS = Layout("speculators", LayerPlan((), "none", 0))   # the layout when none is given


MAX_REASON = 300                  # characters of a skip's reason kept in the manifest and the event


class DiskFullError(Exception):
    pass


def write_sample_file(layout: Layout, out_dir: str, index: int, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str], spill: tuple[str, ...] = ()) -> int:
    """Write sample `index` where `layout` puts it, atomically: a `.tmp-` file at the top of its
    folder (no reader lists it), fsync, rename into place. With `spill` (the other disks of [run]
    output) its bytes go to the disk whose turn it is (files.disk_of) and the output folder gets a
    link to them where the layout puts the sample. Returns its size in bytes."""
    root = disk_of(index, (out_dir, *spill))
    final = layout.path(root, index)
    tmp = os.path.join(root, f"{protocol.TEMP_PREFIX}{index}-{os.getpid()}-{threading.get_ident()}")
    os.makedirs(os.path.dirname(final), exist_ok=True)
    with disk_full_says(f"sample {index} to {root}"):
        replace_atomically(final, lambda path: layout.save(tensors, path, metadata), tmp)
        if root != out_dir:
            link = layout.path(out_dir, index)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            link_atomically(os.path.abspath(final), link)
    return os.path.getsize(final)


@contextlib.contextmanager
def disk_full_says(what: str):
    """A full disk (however the library that wrote reports it) becomes DiskFullError naming `what`."""
    try:
        yield
    except Exception as e:
        full = (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or "No space left" in str(e)
        if full:
            raise DiskFullError(f"disk full writing {what}") from None
        raise


def write_json_atomic(path: str, obj: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
    with disk_full_says(path):
        replace_atomically(path, write)


def write_lines_atomic(path: str, lines: list[str]) -> None:
    """Replace a JSON-lines file whole: a reader sees the old one or the new one."""
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in lines))
    with disk_full_says(path):
        replace_atomically(path, write)


class OwnerError(Exception):
    """The output folder is another run's, or another process writes this shard there now."""




def claim_output(out_dir: str, run: str | None, plan_created: float | None, shard: int | str) -> Any:
    """One writer per output folder. The folder records the run (and plan) that owns it
    (`.fleet/owner.json`, claimed by the first shard that writes there); another run's shard is
    refused, naming the owner and the way out. Each shard then holds an exclusive lock on
    `.fleet/<shard>.lock` while it writes, so a second process for the same shard (a second
    run, a leftover) is refused too. Returns the open lock file: keep it for the process's life."""
    import fcntl
    import socket
    work = os.path.join(out_dir, WORK_DIR)
    os.makedirs(work, exist_ok=True)
    if run is not None:
        with open(os.path.join(work, "owner.lock"), "a") as guard:
            with contextlib.suppress(OSError):           # (a file system without locks: no guard)
                fcntl.flock(guard, fcntl.LOCK_EX)        # two first shards of two runs: one wins
            path = os.path.join(out_dir, OWNER_PATH)
            try:
                with open(path) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                owner = None
            if isinstance(owner, dict) and owner.get("run") not in (None, run):
                raise OwnerError(
                    f"{out_dir} belongs to run {owner['run']!r} ({path}, claimed from "
                    f"{owner.get('host', '?')}): run {run!r} would write beside it. Give this run "
                    f"another output; or, if run {owner['run']!r} is finished with and its files "
                    f"are to be kept as this run's, remove {path}")
            if not isinstance(owner, dict) or owner.get("plan_created") != plan_created:
                write_json_atomic(path, {"run": run, "plan_created": plan_created,
                                         "host": socket.gethostname(), "since": round(time.time(), 3)})
    lock, holder = lock_shard(out_dir, shard)
    while lock is None and holder and SHIPPING_LEFTOVERS in holder:   # a mate ships what it left: wait
        time.sleep(1.0)
        lock, holder = lock_shard(out_dir, shard)
    if lock is None:
        what = f"shard {shard}" if isinstance(shard, int) else f"the {shard}"
        way = "stop it first (fleet down on the run that started it)" if isinstance(shard, int) \
            else "let it finish, or stop it first"
        raise OwnerError(f"{what} of {out_dir} is being written by {holder} "
                         f"({os.path.join(work, f'{shard}.lock')}): {way}") from None
    with contextlib.suppress(OSError):          # who holds it, for the refusal: best effort (a full disk)
        lock.truncate(0)
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}" + (f", run {run!r}" if run else "") + "\n")
        lock.flush()
    return lock


def remove_stale_temps(out_dir: str, start: int, stop: int, spill: tuple[str, ...] = ()) -> int:
    """Remove the temp files a killed writer left for samples [start, stop) (`.tmp-<index>-...`,
    in the output folder and the other disks' of `spill`; the caller holds those samples' lock,
    so no live writer owns them). How many."""
    removed = 0
    for root in (out_dir, *spill):
        for name in os.listdir(root) if os.path.isdir(root) else []:
            head = name[len(protocol.TEMP_PREFIX):].split("-", 1)[0]
            if name.startswith(protocol.TEMP_PREFIX) and head.isdigit() and start <= int(head) < stop:
                try:
                    os.unlink(os.path.join(root, name))
                    removed += 1
                except FileNotFoundError:
                    pass
    return removed


def load_finished(out_dir: str) -> dict[int, dict]:
    """Every index any shard's manifest records (written or skipped), whatever the shard count."""
    return {rec["index"]: rec for rec in manifest_records(out_dir)}


class Manifest:
    """Append-only record of finished samples. A torn last line (kill mid-append) is cut off."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        if os.path.exists(path):
            with open(path, "rb+") as f:
                data = f.read()
                if data and not data.endswith(b"\n"):
                    f.truncate(data.rfind(b"\n") + 1)

    def append(self, records: list[dict]) -> None:
        if not records:
            return
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records).encode()
        with disk_full_says(self.path):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)


class HostBuffers:
    """A fixed number of reusable (pinned, when on CUDA) host byte buffers; acquiring blocks when
    all are out, which is how the writer's backlog bounds host memory and how the GPU's wait is
    measured."""

    def __init__(self, count: int, pinned: bool, on_peak: Callable[[int], None] | None = None):
        self.pinned = pinned
        self.on_peak = on_peak
        self._free: queue.Queue[torch.Tensor | None] = queue.Queue()
        for _ in range(count):
            self._free.put(None)          # allocated lazily at the first size needed
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}

    def acquire(self, nbytes: int, reserve: int = 0) -> tuple[torch.Tensor, float]:
        """A uint8 buffer of at least `nbytes`; a new one is sized max(nbytes, reserve) so that
        batches under the token budget never reallocate (pinning is slow)."""
        t0 = time.perf_counter()
        buf = self._free.get()
        waited = time.perf_counter() - t0
        if buf is None or buf.numel() < nbytes:
            if buf is not None:
                self._sizes.pop(id(buf), None)
            buf = torch.empty(max(nbytes, reserve), dtype=torch.uint8, pin_memory=self.pinned)
            self._sizes[id(buf)] = buf.numel()
            self.peak_bytes = max(self.peak_bytes, sum(self._sizes.values()))
            if self.on_peak:
                self.on_peak(self.peak_bytes)
        return buf, waited

    def release(self, buf: torch.Tensor) -> None:
        self._free.put(buf)


def _align(n: int, to: int = 64) -> int:
    return (n + to - 1) // to * to


def host_views(buf: torch.Tensor, shape: tuple[int, int, int, int], dtype: str
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Views of a host byte buffer holding a batch as stored: hidden [B, S, n, H] (bf16 or fp8)
    and, for fp8, its scales [B, S, n, 1] float32 after it (64-byte aligned)."""
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    if dtype != "fp8":
        return buf[: 2 * numel].view(torch.bfloat16).view(shape), None
    start = _align(numel)
    scales = buf[start: start + 4 * (numel // shape[3])].view(torch.float32).view(*shape[:3], 1)
    return buf[:numel].view(fp8.FP8).view(shape), scales


def batch_bytes(shape: tuple[int, int, int, int], dtype: str) -> int:
    """Host bytes a batch of this shape needs as stored (what host_views lays out)."""
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    return 2 * numel if dtype != "fp8" else _align(numel) + 4 * (numel // shape[3])


@dataclass
class Stats:
    """Counters the writer updates and the progress ticker reads."""
    done: int = 0
    tokens: int = 0
    sq_tokens: int = 0                   # sum of each written row's tokens squared (attention's work)
    bytes: int = 0
    skipped: int = 0
    writer_wait_s: float = 0.0           # the forward waited for a free host buffer (the writer behind)
    ship_wait_s: float = 0.0             # the writer waited for room under keep_local (shipping behind)
    host_buffer_bytes: int = 0           # the writer's host buffers: its bound on host memory
    counted_t: float | None = None       # when the rows last written were counted (wall clock)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def snapshot(self) -> dict:
        with self.lock:
            return {"done": self.done, "tokens": self.tokens, "sq_tokens": self.sq_tokens, "bytes": self.bytes,
                    "skipped": self.skipped, "writer_wait_s": round(self.writer_wait_s, 3),
                    "ship_wait_s": round(self.ship_wait_s, 3),
                    "host_buffer_bytes": self.host_buffer_bytes,
                    **({"counted_t": round(self.counted_t, 3)} if self.counted_t is not None else {})}


@dataclass
class BatchJob:
    samples: list                 # data.Sample, in batch row order
    host: torch.Tensor            # the host byte buffer (returned to the pool when written)
    hidden: torch.Tensor          # view of it: [B, S, n, H] as stored (bf16 or fp8)
    scales: torch.Tensor | None   # fp8: view of it, [B, S, n, 1] float32
    finite: torch.Tensor          # bool [B] (host)
    ready: Any                    # torch.cuda.Event or None
    final: bool = False           # the rows' last try (alone): a non-finite row is skipped
    stats: torch.Tensor | None = None   # [B, n, 4] (host): each row's statistics per layer (worker/stats.py)


def file_bytes_at_most(job: BatchJob, row: int, tokens: int) -> int:
    """An upper bound on the file of `row`: its hidden states (and fp8 scales), 8 bytes a token
    for each of input_ids and loss_mask (the widest any format stores) and 4 kB of header."""
    scales = job.scales[row, :tokens].nbytes if job.scales is not None else 0
    return job.hidden[row, :tokens].nbytes + scales + 16 * tokens + 4096


class BackgroundWriter:
    """One thread takes batches off a bounded queue; a small pool writes their files in parallel."""

    def __init__(self, out_dir: str, manifest: Manifest, metadata: dict[str, str], stats: Stats,
                 depth: int, file_threads: int, device: torch.device,
                 on_skip: Callable[[int, str], None], reserve_tokens: int = 0,
                 layout: Layout = SPECULATORS, shipper: Any = None, spill: tuple[str, ...] = (),
                 checks: Any = None):
        self.out_dir = out_dir
        self.checks = checks                  # worker/reference.py: the chosen rows' contents go to it
        self.spill = spill                    # the other disks its samples' bytes go to in turn
        self.shipper = shipper                # worker/ship.py: files it records go to the destination
        self.layout = layout
        self.dtype = layout.dtype
        self.reserve_tokens = reserve_tokens
        self.manifest = manifest
        self.metadata = metadata
        self.stats = stats
        self.on_skip = on_skip
        self.cuda = device.type == "cuda"
        self.buffers = HostBuffers(depth + 1, pinned=self.cuda,
                                   on_peak=lambda n: setattr(stats, "host_buffer_bytes", n))
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.jobs: queue.Queue = queue.Queue()
        self.files = ThreadPoolExecutor(max_workers=file_threads, thread_name_prefix="hs-write")
        self.error: BaseException | None = None
        self._retries: list = []              # non-finite rows of a batch: the extractor retries them alone
        self._retries_lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="hs-writer", daemon=True)
        self.thread.start()

    # --- called from the GPU loop ---------------------------------------------------------------
    def submit(self, samples: list, hidden: torch.Tensor, finite: torch.Tensor, final: bool = False,
               lengths: torch.Tensor | None = None) -> None:
        """Hand over one batch: hidden [B, S, n, H] bf16 on the device, finite bool [B], the rows'
        lengths [B] on the device (None: made here from `samples`).

        fp8: `hidden` (the extractor's own stacked copy, which it is done with) is quantised in
        place on the device, and only the fp8 values and their scales cross to the host. Each row's
        statistics per layer (worker/stats.py) are taken on the device from the values as stored
        and cross with them."""
        self.raise_if_failed()
        B, S, n, H = hidden.shape
        shape = (B, S, n, H)
        scales = None
        if lengths is None:
            lengths = torch.tensor([s.length for s in samples], device=hidden.device)
        with torch.inference_mode():
            if self.dtype == "fp8":
                hidden, scales = fp8.quantize(hidden, inplace=True)
            stats = batch_stats(hidden, lengths, scales)
            if inject.bug("fp8-no-scales") and scales is not None:
                scales.fill_(1.0)                      # (a test's bug: the scales lost on the way)
        reserve = batch_bytes((1, self.reserve_tokens, n, H), self.dtype) if self.reserve_tokens else 0
        buf, waited = self.buffers.acquire(batch_bytes(shape, self.dtype), reserve=reserve)
        with self.stats.lock:
            self.stats.writer_wait_s += waited
        target, target_scales = host_views(buf, shape, self.dtype)
        sources = [(target, hidden)]
        if scales is not None:
            assert target_scales is not None, "host_views lays out fp8's scales"
            sources.append((target_scales, scales))
        if self.cuda:
            assert self.copy_stream is not None, "made where the device is CUDA"
            self.copy_stream.wait_stream(torch.cuda.current_stream(hidden.device))
            with torch.cuda.stream(self.copy_stream):
                for dst, src in sources:
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(self.copy_stream)
                finite_host = finite.to("cpu", non_blocking=True)
                stats_host = stats.to("cpu", non_blocking=True)
                finite.record_stream(self.copy_stream)
                stats.record_stream(self.copy_stream)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
        else:
            for dst, src in sources:
                dst.copy_(src)
            finite_host, stats_host, ready = finite.clone(), stats, None
        self.jobs.put(BatchJob(samples, buf, target, target_scales, finite_host, ready, final, stats_host))

    def skip(self, index: int, reason: str) -> None:
        """Record a sample that will not be written (malformed row, too long, OOM)."""
        self.raise_if_failed()
        self.jobs.put(("skip", index, reason))

    def flush(self) -> None:
        """Wait until every batch handed over so far is written (or skipped, or to be retried)."""
        done = threading.Event()
        self.jobs.put(("flush", done))
        done.wait()
        self.raise_if_failed()

    def take_retries(self) -> list:
        with self._retries_lock:
            out, self._retries = self._retries, []
        return out

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()
        self.files.shutdown()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    # --- writer thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if self.error is not None and not (isinstance(job, tuple) and job[0] == "flush"):
                if isinstance(job, BatchJob):
                    self.buffers.release(job.host)
                continue
            if isinstance(job, tuple) and job[0] == "flush":
                job[1].set()
                continue
            try:
                if isinstance(job, tuple):
                    self._record_skip(job[1], job[2])
                else:
                    self._write_batch(job)
            except BaseException as e:       # surfaced to the GPU loop at its next submit
                self.error = e

    def _write(self, sample, hidden: torch.Tensor, scales: torch.Tensor | None, meta: dict[str, str],
               stats: torch.Tensor | None = None) -> dict:
        """The sample's file written; its manifest record: with the statistics of each layer as
        stored and a checksum of its tokens (verify's content checks), and, for a file that will be
        shipped, its MD5 read back from the disk (verify compares the destination's copy with it)."""
        tensors = self.layout.pack(hidden, torch.from_numpy(sample.input_ids),
                                   torch.from_numpy(sample.loss_mask), scales)
        size = write_sample_file(self.layout, self.out_dir, sample.index, tensors, meta, self.spill)
        if self.checks is not None and self.checks.wanted(sample.index):
            # copies: speculators' states are a view of the host buffer, which the next batch reuses
            self.checks.written(sample.index, {k: v.clone() for k, v in tensors.items()}, sample.chat)
        record = {"index": sample.index, "tokens": sample.length, "bytes": size}
        if stats is not None:
            record["stats"] = rounded(stats)
            record["ids_crc"] = zlib.crc32(sample.input_ids.astype("<i8").tobytes())
        if self.shipper is not None:
            record["md5"] = file_md5(self.layout.path(self.out_dir, sample.index))
        return record

    def _record_skip(self, index: int, reason: str) -> None:
        reason = reason if len(reason) <= MAX_REASON else reason[:MAX_REASON - 1] + "…"
        self.manifest.append([{"index": index, "skipped": reason}])
        with self.stats.lock:
            self.stats.skipped += 1
        self.on_skip(index, reason)

    def _write_batch(self, job: BatchJob) -> None:
        try:
            if job.ready is not None:
                job.ready.synchronize()
            n, H = job.hidden.shape[2:]
            if self.shipper is not None:      # keep_local: wait for room before the disk grows
                t0 = time.perf_counter()
                self.shipper.room(sum(file_bytes_at_most(job, row, s.length) for row, s in enumerate(job.samples)))
                with self.stats.lock:
                    self.stats.ship_wait_s += time.perf_counter() - t0
            futures: list[tuple[Any, Future[dict] | str]] = []      # a row's write, or why it is skipped
            for row, sample in enumerate(job.samples):
                if not bool(job.finite[row]):
                    if job.final:
                        futures.append((sample, "non-finite hidden states (alone, after the rest)"))
                    else:
                        with self._retries_lock:
                            self._retries.append(sample)
                    continue
                T = sample.length
                hidden = job.hidden[row, :T]
                scales = job.scales[row, :T] if job.scales is not None else None
                if hidden.shape != (T, n, H) or sample.loss_mask.shape != (T,):
                    futures.append((sample, "shape mismatch"))
                    continue
                meta = dict(self.metadata, sample_index=str(sample.index))
                row_stats = job.stats[row] if job.stats is not None else None
                futures.append((sample, self.files.submit(self._write, sample, hidden, scales, meta, row_stats)))
            records: list[dict] = []
            first_error: BaseException | None = None
            for sample, fut in futures:
                if isinstance(fut, str):
                    self._record_skip(sample.index, fut)
                    continue
                try:
                    records.append(fut.result())
                except BaseException as e:       # keep what did get written, then fail
                    first_error = first_error or e
            self.manifest.append(records)
            if self.shipper is not None and records:
                self.shipper.add(records)
            with self.stats.lock:
                self.stats.done += len(records)
                self.stats.tokens += sum(r["tokens"] for r in records)
                self.stats.sq_tokens += sum(r["tokens"] ** 2 for r in records)
                self.stats.bytes += sum(r["bytes"] for r in records)
                self.stats.counted_t = protocol.now()
            if first_error is not None:
                raise first_error
        finally:
            self.buffers.release(job.host)
