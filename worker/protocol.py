"""The wire format between workers, the host agent and the supervisor.

Standard library only: this file travels to every GPU host and is imported by `fleet` too, so the
two sides can never disagree on a record. Every record is one JSON object on one line.

Events (appended by a worker or its runner to ``<shard dir>/events.jsonl``)::

    {"event": "<kind>", "t": <unix seconds>, ...fields}

Agent messages (the agent's stdout, one per line)::

    {"type": "hello" | "gpu" | "disk" | "shard" | "event" | "beat" | "error", ...}
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

PROTOCOL_VERSION = 1

# --- event kinds -------------------------------------------------------------------------------
LAUNCH = "launch"            # written by hostctl before the process starts: attempt, by (auto|manual)
STARTED = "started"          # pid, host, device, index range
LOADING = "loading"          # model path
LOADED = "loaded"            # seconds, gpu memory
PROGRESS = "progress"        # done, total, tokens, bytes, writer_wait_s
SAMPLE_SKIPPED = "sample_skipped"  # index, reason
WARNING = "warning"          # message
DONE = "done"                # totals
FAILED = "failed"            # reason, traceback tail
EXITED = "exited"            # written by the runner: code (negative = signal), stopped
SENTINEL = "sentinel"        # synthesised by the agent for custom jobs: which regex matched, line

EVENT_KINDS = (LAUNCH, STARTED, LOADING, LOADED, PROGRESS, SAMPLE_SKIPPED, WARNING, DONE, FAILED,
               EXITED, SENTINEL)

# --- remote layout -----------------------------------------------------------------------------
EVENTS_FILE = "events.jsonl"
LOG_FILE = "log"
PID_FILE = "pid"
LOCK_FILE = "lock"
MANIFEST_DIR = "manifest"
META_FILE = "meta.json"
SAMPLE_PREFIX = "hs_"
SAMPLE_SUFFIX = ".safetensors"
TEMP_PREFIX = ".tmp-"        # temp files start with a dot: no `hs_*.safetensors` glob matches them


def sample_file_name(index: int) -> str:
    return f"{SAMPLE_PREFIX}{index}{SAMPLE_SUFFIX}"


def shard_dir(run_dir: str, shard: int) -> str:
    return os.path.join(run_dir, "shards", str(shard))


def make_event(kind: str, **fields: Any) -> dict:
    if kind not in EVENT_KINDS:
        raise ValueError(f"unknown event kind {kind!r}")
    return {"event": kind, "t": round(time.time(), 3), **fields}


def append_jsonl(path: str, record: dict, sync: bool = True) -> None:
    """Append one record as a single write, so concurrent appenders never interleave a line."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl_from(path: str, offset: int = 0) -> tuple[list[dict], int]:
    """Complete records from byte `offset` on, and the offset after the last complete line.

    A trailing partial line (a writer killed mid-write, or one still writing) is left for the next
    call; a line that is not JSON is skipped.
    """
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    records = []
    for raw in data[: end + 1].splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records, offset + end + 1


def iter_jsonl(path: str) -> Iterator[dict]:
    records, _ = read_jsonl_from(path, 0)
    yield from records


def encode(message: dict) -> str:
    return json.dumps(message, separators=(",", ":"))
