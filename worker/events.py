"""The worker's event log: typed records appended to events.jsonl for fleet, one human-readable
line on stdout for people. A progress event whose counters did not move since the last one printed
is a heartbeat: fleet reads it (liveness, LATE, stalls), the log does not repeat it."""

from __future__ import annotations

import os
import sys
import threading

from . import protocol
from .launches import LaunchState

# Events whose loss would change a shard's state are fsync'd; progress lines are not.
_SYNCED = (protocol.Started, protocol.Loaded, protocol.Done, protocol.Failed, protocol.SampleSkipped)


class EventLog:
    def __init__(self, state_dir: str | None, shard: int):
        self.path = os.path.join(state_dir, protocol.EVENTS_FILE) if state_dir else None
        if state_dir:
            os.makedirs(state_dir, exist_ok=True)
        self.shard = shard
        launch = os.environ.get(protocol.LAUNCH_ENV, "")
        self.launch = int(launch) if launch.isdigit() else None
        self.total_tokens: int | None = None      # set once known (worker/sizing.py)
        self.work: dict = {}                      # total_rows, total_sq_tokens, attention_weight (sizing)
        self._lock = threading.Lock()
        self._printed: tuple | None = None        # the counters of the last progress line printed

    def emit(self, event: protocol.Record) -> protocol.Record:
        """Stamp the event with this process's launch (and a progress event with the shard's
        total tokens, once known) and append it (a single write)."""
        if hasattr(event, "launch") and event.launch is None and self.launch is not None:
            event.launch = self.launch                # (every event record has the field; to_dict writes fields alone)
        if isinstance(event, protocol.Progress) and event.total_tokens is None:
            event.total_tokens = self.total_tokens
        if isinstance(event, protocol.Progress):
            for key, value in self.work.items():
                if getattr(event, key, None) is None:
                    setattr(event, key, value)
        with self._lock:
            if self.path:
                protocol.append_jsonl(self.path, event, sync=isinstance(event, _SYNCED))
            if not self._moved(event):
                return event
            fields = {k: v for k, v in event.to_dict().items()
                      if k not in ("event", "t", "launch", "traceback")}
            print(f"[shard {self.shard}] {event.KIND} " + " ".join(f"{k}={v}" for k, v in fields.items()),
                  file=sys.stdout, flush=True)
        return event

    def _moved(self, event: protocol.Record) -> bool:
        """Whether the event is worth a log line: anything but a progress heartbeat whose counters
        are those of the last progress line printed."""
        if type(event) is not protocol.Progress:
            return True
        counters = (event.done, event.skipped, event.total, event.tokens, event.total_tokens)
        moved, self._printed = counters != self._printed, counters
        return moved

    def stop_requested(self) -> protocol.StopRequested | None:
        """The stop `hostctl stop` recorded for this launch before it signalled, if any: a SIGTERM
        that was asked for (k, D, fleet down, a restart) is a stop, not a failure."""
        if not self.path or self.launch is None:
            return None
        return LaunchState.read(self.path).stop_of(self.launch)
