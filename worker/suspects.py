"""Rows that may have killed the worker, remembered across launches so a crash loop bisects.

A CUDA device-side assert (or anything else that kills the process from inside a batch) leaves no
exception to catch, and the next launch's longest-first order would put the same batch first
again. So before each batch the worker records which rows are in flight (the last few batches:
a GPU error can surface a batch or two late) in `<out>/.fleet/<shard>.suspects.json`. The next
launch takes the rows it finds there and did not finish as suspects: they run after the rest,
each alone and synchronously. A row that was in flight alone when the process died is the
culprit: it is skipped, with that reason. Each bad row costs one launch; clean rows are never lost.

No fsync: the file has to survive the process, not the host.
"""

from __future__ import annotations

import json
import os
from collections import deque

from .files import write_atomic

WINDOW = 8                     # batches (or micro-batches) kept in flight in the record


def suspects_path(out_dir: str, shard: int) -> str:
    return os.path.join(out_dir, ".fleet", f"{shard}.suspects.json")


class Suspects:
    def __init__(self, path: str, finished: set[int], start: int, stop: int):
        self.path = path
        try:
            with open(path) as f:
                state = json.load(f)
            if not isinstance(state, dict):
                state = {}
        except (OSError, ValueError):
            state = {}
        inflight = [i for i in state.get("inflight", []) if isinstance(i, int)]
        alone = bool(state.get("alone")) and len(inflight) == 1
        known = {i for i in state.get("suspects", []) if isinstance(i, int)} | set(inflight)
        todo = {i for i in known if start <= i < stop and i not in finished}
        self.culprit = inflight[0] if alone and inflight[0] in todo else None
        self.rows = todo - {self.culprit}
        self._recent: deque[list[int]] = deque(maxlen=WINDOW)
        self._alone = False
        if self.rows or self.culprit is not None or state:
            self._save()

    def starting(self, indices: list[int], alone: bool = False) -> None:
        """Record a batch as in flight before it runs; `alone`: one suspect on its own."""
        if alone or self._alone:
            self._recent.clear()
        self._alone = alone
        self._recent.append(list(indices))
        self._save()

    def settled(self) -> None:
        """The process ends on its own terms (done, stopped): nothing in flight killed it."""
        self._recent.clear()
        self._alone = False
        if os.path.exists(self.path):
            self._save()

    def _save(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        inflight = [i for batch in self._recent for i in batch]
        from .writer import disk_full_says        # a full disk here is a disk-full failure too
        with disk_full_says(self.path):
            write_atomic(self.path, json.dumps({"suspects": sorted(self.rows), "inflight": inflight,
                                                "alone": self._alone}), sync=False)
