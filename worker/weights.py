"""How far the reading of a checkpoint has got, while it is read (issue 38): LOADING says
"reading the weights: 6.1 GB of 16.4 GB (1.9 GB/s)" instead of a minute of silence for a 27B model.

The measure is the bytes the loaded tensors hold where they are going: the GPU's allocated memory
for a model read straight onto it (transformers places each tensor as it reads it), the process's
resident memory for one read into host memory first — both grow as the files are read, and
neither needs a hook into transformers' loader.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import torch

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def checkpoint_bytes(path: str) -> int:
    """The bytes of the weight files in a model folder (what a load reads)."""
    total = 0
    for name in os.listdir(path) if os.path.isdir(path) else []:
        if name.endswith(WEIGHT_SUFFIXES):
            try:
                total += os.path.getsize(os.path.join(path, name))
            except OSError:
                pass
    return total


def placed_bytes(device: str) -> Callable[[], int]:
    """A counter of the bytes placed so far on `device` (from now)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = torch.device(device)
        start = torch.cuda.memory_allocated(dev)
        return lambda: torch.cuda.memory_allocated(dev) - start
    start = _rss()
    return lambda: max(0, _rss() - start)


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class ReadProgress:
    """A thread that calls `report(done, total, rate)` every `interval` seconds while the block
    runs (done and total in bytes, rate in bytes/s since the start)."""

    def __init__(self, total: int, placed: Callable[[], int], report: Callable[[int, int, float], None],
                 interval: float = 2.0):
        self.total, self.placed, self.report, self.interval = total, placed, report, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights-progress", daemon=True)
        self.t0 = time.monotonic()

    def __enter__(self) -> "ReadProgress":
        if self.total > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            done = min(self.placed(), self.total)
            self.report(done, self.total, done / max(time.monotonic() - self.t0, 1e-6))
