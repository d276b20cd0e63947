"""JSON-lines files as both sides keep them: appended one whole line at a time (never a torn one),
and read as they grow, each byte once, lines that are no record passed over and counted. The shard's
record (events.jsonl) is read through these, typed by the events' parser."""

from __future__ import annotations

import errno
import json
import os
from typing import Iterator

from .events import Event, parse_event
from .records import Record


def append_jsonl(path: str, record: Record | dict, sync: bool = True) -> None:
    """Append one record as a single write, so concurrent appenders never interleave a line. A write
    the disk cut short (full) is taken back and raised as OSError: never a torn line that would
    swallow the next record too."""
    text = record.to_json() if isinstance(record, Record) else json.dumps(record, separators=(",", ":"))
    line = (text + "\n").encode()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        before = os.fstat(fd).st_size
        if before and os.pread(fd, 1, before - 1) != b"\n":
            line = b"\n" + line        # after a torn or foreign tail: a record of its own, never glued to it
        written = os.write(fd, line)
        if written != len(line):
            os.ftruncate(fd, before)
            raise OSError(errno.ENOSPC, f"no space left for a record in {path}")
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


class JsonlTail:
    """A JSON-lines file read as it grows, a bounded chunk at a time, each byte once: complete
    records from where the last read stopped. A line that is not a JSON object, and a line that
    runs past MAX_RECORD_BYTES without ending (no writer writes one: garbage, a foreign file),
    count as unreadable (`bad_bytes`, `bad_lines`, the first after `bad_after` good lines) and are
    passed over; a short unended line waits for its end (a writer still writing)."""
    CHUNK = 8 << 20
    MAX_RECORD_BYTES = 1 << 20

    def __init__(self, path: str):
        self.path = path
        self.offset = 0                 # the start of the first line not yet read
        self.skipping = False           # inside an unended line too long to be a record
        self.lines = self.bad_lines = self.bad_bytes = 0
        self.bad_after: int | None = None

    def read(self) -> list[dict]:
        records: list[dict] = []
        try:
            f = open(self.path, "rb")
        except FileNotFoundError:
            return records
        with f:
            while True:
                f.seek(self.offset)
                data = f.read(self.CHUNK)
                end = data.rfind(b"\n")
                if end < 0:
                    if len(data) >= self.MAX_RECORD_BYTES or (self.skipping and data):
                        self._bad(len(data), line=not self.skipping)
                        self.offset, self.skipping = self.offset + len(data), True
                        continue
                    return records
                for raw in data[:end + 1].split(b"\n")[:-1]:
                    self._take(raw, records)
                self.offset += end + 1
                if len(data) < self.CHUNK and len(data) - end - 1 < self.MAX_RECORD_BYTES:
                    return records

    def _take(self, raw: bytes, records: list[dict]) -> None:
        if self.skipping:                       # the end of a line already counted unreadable
            self.skipping = False
            self._bad(len(raw) + 1, line=False)
            return
        try:
            rec = json.loads(raw) if raw.strip() else None
        except ValueError:
            rec = False
        if isinstance(rec, dict):
            self.lines += 1
            records.append(rec)
        elif rec is not None:
            self._bad(len(raw) + 1)

    def _bad(self, n: int, line: bool = True) -> None:
        if self.bad_after is None:
            self.bad_after = self.lines
        self.bad_bytes += n
        self.bad_lines += line


def iter_jsonl(path: str) -> Iterator[dict]:
    """Every complete record of a JSON-lines file (its unreadable lines passed over)."""
    yield from JsonlTail(path).read()


def read_events(path: str) -> list[Event]:
    """Every typed event of a shard's record, in order."""
    return [e for e in map(parse_event, iter_jsonl(path)) if e is not None]
