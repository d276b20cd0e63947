"""A [job]'s log lines and output files, turned into the events the built-in worker writes itself.

The runner owns this: it starts the job, so it reads the job's log from the byte where this launch
began and appends each event the moment the line appears, before it records the exit. The record
is then complete and in order whether or not a supervisor is watching. Standard library only.
"""

from __future__ import annotations

import glob
import os
import re
import time

from . import protocol
from .protocol import SentinelSpec   # the spec is a wire record; judged here

MAX_LINE = 64 * 1024           # a line longer than this is matched on its last 64 KiB
QUOTE = 300                    # characters of a matched line an event carries
CHUNK = 1 << 20                # bytes read per call: a huge burst is read in bounded steps
PROGRESS_EVERY_S = 1.0         # at most one progress event a second from log lines
GLOB_EVERY_S = 2.0             # how often output files are counted
TRACEBACK = "Traceback (most recent call last)"   # a fail line that says less than the line ending it



class LogWatcher:
    """Reads new bytes of the log from `offset`, splits lines on \\n or \\r (progress bars redraw
    with \\r), and returns the events they mean. A partial line is kept (bounded) for the next call."""

    def __init__(self, spec: SentinelSpec, log_path: str, offset: int, launch: int, shard: int):
        self.spec = spec
        self.path = log_path
        self.offset = offset
        self.launch = launch
        self.done = re.compile(spec.done) if spec.done else None
        self.fail = re.compile(spec.fail) if spec.fail else None
        self.progress = re.compile(spec.progress) if spec.progress else None
        self.glob = spec.progress_glob.replace("{shard}", str(shard)) if spec.progress_glob else None
        self.partial = b""
        self.traceback: str | None = None      # a matched traceback header, until its exception line
        self.pending_progress: protocol.Progress | None = None
        self.last_progress_t = 0.0
        self.last_glob_t = 0.0
        self.glob_count = -1

    def poll(self, final: bool = False) -> list[protocol.Record]:
        """Events since the last call. `final`: the process has ended — read to the end, match a
        last unterminated line, flush the pending progress and count the output files once more."""
        events: list[protocol.Record] = []
        if self.done or self.fail or self.progress:
            self._read(events, final)
        now = time.monotonic()
        if self.pending_progress is not None and (final or now - self.last_progress_t >= PROGRESS_EVERY_S):
            events.append(self.pending_progress)
            self.pending_progress = None
            self.last_progress_t = now
        if self.glob and (final or now - self.last_glob_t >= GLOB_EVERY_S):
            self.last_glob_t = now
            count = len(glob.glob(self.glob))
            if count != self.glob_count:
                self.glob_count = count
                events.append(protocol.Progress(launch=self.launch, done=count, total=self.spec.total))
        return events

    def _read(self, events: list, final: bool) -> None:
        while True:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read(CHUNK)
            except FileNotFoundError:
                return
            if not data:
                break
            self.offset += len(data)
            data = self.partial + data
            parts = re.split(rb"\r\n|\r|\n", data)
            self.partial = parts.pop()[-MAX_LINE:]
            for raw in parts:
                self._match(raw[-MAX_LINE:], events)
            if len(data) < CHUNK:
                break
        if final and self.partial:
            self._match(self.partial, events)
            self.partial = b""
        if final and self.traceback is not None:   # it ended inside the traceback: the header, then
            events.append(protocol.Sentinel(launch=self.launch, match="fail", line=self.traceback))
            self.traceback = None

    def _match(self, raw: bytes, events: list) -> None:
        line = raw.decode("utf-8", "replace")
        if self.traceback is not None:             # a fail line that opened a traceback: its
            if line.strip() and not line[:1].isspace():   # exception line says what failed
                events.append(protocol.Sentinel(launch=self.launch, match="fail", line=quoted(line, 0)))
                self.traceback = None
            return
        if self.fail and (m := self.fail.search(line)):
            if line.strip().startswith(TRACEBACK):
                self.traceback = line.strip()
                return
            events.append(protocol.Sentinel(launch=self.launch, match="fail", line=quoted(line, m.start())))
        elif self.done and (m := self.done.search(line)):
            events.append(protocol.Sentinel(launch=self.launch, match="done", line=quoted(line, m.start())))
        elif self.progress and (m := self.progress.search(line)):
            g = m.groupdict()
            try:
                done = int(g.get("done") or 0)
                total = int(g["total"]) if g.get("total") else self.spec.total
            except ValueError:
                return
            self.pending_progress = protocol.Progress(launch=self.launch, done=done, total=total)


def quoted(line: str, at: int, limit: int = QUOTE) -> str:
    """A matched line as its event carries it: from the start of the word where the pattern
    matched (an exception's name: `ValueError: bad row`), so a long line cut to `limit`
    characters keeps what failed, not what came before it."""
    start = at
    while start > 0 and not line[start - 1].isspace():
        start -= 1
    return line[start:].strip()[:limit]


def log_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
