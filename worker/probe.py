"""Free disk at a path that may not exist yet (the output folder before the first file): the one
probe that preflight and the agent share; and the rate a disk takes files as the writer writes
them (preflight's, and bench/extract.py's). Standard library only."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

PROBE_FILES = 8                  # written at once, as several shards' writers do
PROBE_MAX_FILE = 32 << 20        # so a probe writes at most 256 MiB a disk


@dataclass(frozen=True)
class DiskSpace:
    path: str          # the folder asked about
    probe: str         # the nearest existing folder, which statvfs measured
    free: int          # bytes available to this user
    total: int


def disk_space(path: str) -> DiskSpace:
    """statvfs of `path` or its nearest existing parent; OSError when even that fails."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return DiskSpace(path, probe, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)


def timed_writes(folder: str, file_bytes: int, count: int, threads: int = PROBE_FILES) -> float:
    """Seconds to write `count` files of `file_bytes` into a new folder under `folder`, each
    fsync'd as the writer does, `threads` at once; the folder is removed after. OSError (no room,
    not writable) passes up."""
    where = tempfile.mkdtemp(dir=folder, prefix=".fleet-disk-")
    block = os.urandom(file_bytes)

    def one(i: int) -> None:
        with open(os.path.join(where, f"{i}.bin"), "wb") as f:
            f.write(block)
            f.flush()
            os.fsync(f.fileno())
    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(count)))
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(where, ignore_errors=True)


def write_rate(folders: list[str], seconds: float = 1.0) -> float | None:
    """Bytes a second the disks under `folders` take as the shards' writers write (fsync'd files,
    8 at once): each distinct disk measured in rounds of growing files until one takes `seconds`
    (at most 8 x 32 MiB), the disks' rates summed (shards spread their files over them). None
    when a disk cannot be written."""
    disks: dict[int, str] = {}
    for folder in folders:
        probe = disk_space(folder).probe
        disks.setdefault(os.stat(probe).st_dev, probe)
    total = 0.0
    for probe in disks.values():
        size = 1 << 20
        try:
            while True:
                took = timed_writes(probe, size, PROBE_FILES)
                if took >= seconds or size >= PROBE_MAX_FILE:
                    break
                size = min(PROBE_MAX_FILE, size * 4)
        except OSError:
            return None
        total += PROBE_FILES * size / max(took, 1e-6)
    return total
