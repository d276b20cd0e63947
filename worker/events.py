"""The worker's event log: JSON lines for fleet, one human-readable line on stdout for people."""

from __future__ import annotations

import os
import sys
import threading

from . import protocol

# Events whose loss would change a shard's state are fsync'd; progress lines are not.
_SYNCED = {protocol.STARTED, protocol.LOADED, protocol.DONE, protocol.FAILED, protocol.SAMPLE_SKIPPED}


class EventLog:
    def __init__(self, state_dir: str | None, shard: int):
        self.path = os.path.join(state_dir, protocol.EVENTS_FILE) if state_dir else None
        if state_dir:
            os.makedirs(state_dir, exist_ok=True)
        self.shard = shard
        self._lock = threading.Lock()

    def emit(self, kind: str, **fields) -> dict:
        event = protocol.make_event(kind, **fields)
        with self._lock:
            if self.path:
                protocol.append_jsonl(self.path, event, sync=kind in _SYNCED)
            print(f"[shard {self.shard}] {kind} " + " ".join(f"{k}={v}" for k, v in fields.items()
                                                              if k != "traceback"),
                  file=sys.stdout, flush=True)
        return event
