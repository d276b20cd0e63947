"""`python -m worker.agent`: the supervisor's eyes on one host, streamed as JSON lines on stdout.

It replays each shard's events.jsonl from the start (so a supervisor that reconnects rebuilds its
state from the host's own record), then follows them; reports each shard's liveness (its lock) so
an exit is noticed within one poll; reads GPU telemetry and free disk. For custom jobs it turns log
lines and output-file counts into the same events the built-in worker writes. It exits when its
stdin closes or its stdout breaks, that is, with the SSH channel; the workers do not.

Standard library only (pynvml when present). It reads only the run's own folders.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import socket
import sys
import threading
import time

from . import protocol
from .gpu import GpuReader
from .hostctl import is_running, read_pid

REPLAY_PROGRESS_KEPT = 60         # progress events per shard sent on replay (enough for rates)


class Sentinels:
    """A custom job's log regexes and output glob, turned into synthetic events."""

    def __init__(self, spec: dict, shard: int):
        self.done = re.compile(spec["done"]) if spec.get("done") else None
        self.fail = re.compile(spec["fail"]) if spec.get("fail") else None
        self.progress = re.compile(spec["progress"]) if spec.get("progress") else None
        self.glob = spec["progress_glob"].replace("{shard}", str(shard)) if spec.get("progress_glob") else None
        self.total = spec.get("total")
        self.offset = 0
        self.last_count = -1

    def scan_log(self, path: str) -> list[dict]:
        events = []
        try:
            with open(path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return events
        end = data.rfind(b"\n")
        if end < 0:
            return events
        self.offset += end + 1
        for raw in data[: end + 1].decode("utf-8", "replace").splitlines():
            if self.fail and self.fail.search(raw):
                events.append(protocol.make_event(protocol.SENTINEL, kind="fail", line=raw[-300:]))
            elif self.done and self.done.search(raw):
                events.append(protocol.make_event(protocol.SENTINEL, kind="done", line=raw[-300:]))
            elif self.progress and (m := self.progress.search(raw)):
                g = m.groupdict()
                done = int(g.get("done") or 0)
                total = int(g["total"]) if g.get("total") else self.total
                events.append(protocol.make_event(protocol.PROGRESS, done=done, total=total or 0,
                                                  tokens=0, bytes=0, skipped=0))
        return events

    def scan_glob(self) -> list[dict]:
        if not self.glob:
            return []
        count = len(glob.glob(self.glob))
        if count == self.last_count:
            return []
        self.last_count = count
        return [protocol.make_event(protocol.PROGRESS, done=count, total=self.total or 0,
                                    tokens=0, bytes=0, skipped=0)]


class Agent:
    def __init__(self, run_dir: str, shards: list[int], output: str | None, sentinels: dict | None,
                 out=sys.stdout):
        self.run_dir = run_dir
        self.shards = shards
        self.output = output
        self.out = out
        self.offsets = {k: 0 for k in shards}
        self.alive: dict[int, bool | None] = {k: None for k in shards}
        self.sentinels = {k: Sentinels(sentinels, k) for k in shards} if sentinels else {}
        self.gpus = GpuReader()

    def send(self, message: dict) -> None:
        self.out.write(protocol.encode(message) + "\n")

    def flush(self) -> None:
        self.out.flush()

    def poll_events(self, replay: bool = False) -> None:
        for k in self.shards:
            d = protocol.shard_dir(self.run_dir, k)
            events, self.offsets[k] = protocol.read_jsonl_from(
                os.path.join(d, protocol.EVENTS_FILE), self.offsets[k])
            if k in self.sentinels:
                events += self.sentinels[k].scan_log(os.path.join(d, protocol.LOG_FILE))
                events += self.sentinels[k].scan_glob()
            if replay:
                events = _thin_progress(events)
            for ev in events:
                self.send({"type": "event", "shard": k, "event": ev})

    def poll_alive(self, force: bool = False) -> None:
        for k in self.shards:
            d = protocol.shard_dir(self.run_dir, k)
            alive = is_running(d)
            if force or alive != self.alive[k]:
                self.alive[k] = alive
                self.send({"type": "shard", "shard": k, "alive": alive,
                           "pid": read_pid(d) if alive else None, "t": round(time.time(), 3)})

    def poll_gpu(self) -> None:
        self.send({"type": "gpu", "t": round(time.time(), 3), "source": self.gpus.source,
                   "gpus": self.gpus.read(), "error": self.gpus.error})

    def poll_disk(self) -> None:
        if not self.output:
            return
        path = self.output
        while path and not os.path.exists(path):
            path = os.path.dirname(path.rstrip("/")) or "/"
            if path == "/":
                break
        try:
            st = os.statvfs(path or ".")
            self.send({"type": "disk", "t": round(time.time(), 3), "path": self.output,
                       "free": st.f_bavail * st.f_frsize, "total": st.f_blocks * st.f_frsize})
        except OSError as e:
            self.send({"type": "disk", "t": round(time.time(), 3), "path": self.output,
                       "error": e.strerror})

    def hello(self) -> None:
        self.send({"type": "hello", "protocol": protocol.PROTOCOL_VERSION, "host": socket.gethostname(),
                   "pid": os.getpid(), "t": round(time.time(), 3)})

    def replay(self) -> None:
        """hello, every shard's record so far, liveness, GPUs, disk, then `replayed`."""
        self.hello()
        self.poll_events(replay=True)
        self.poll_alive(force=True)
        self.poll_gpu()
        self.poll_disk()
        self.send({"type": "replayed", "t": round(time.time(), 3)})

    def once(self) -> None:
        self.replay()
        self.send({"type": "end"})
        self.flush()

    def follow(self, interval: float, gpu_interval: float, stop: threading.Event) -> None:
        self.replay()
        self.flush()
        last_gpu = last_disk = last_beat = time.monotonic()
        while not stop.wait(interval):
            # Events before liveness: a dead process's `exited` event is sent before it is "dead".
            self.poll_events()
            self.poll_alive()
            now = time.monotonic()
            if now - last_gpu >= gpu_interval:
                self.poll_gpu()
                last_gpu = now
            if now - last_disk >= 5 * gpu_interval:
                self.poll_disk()
                last_disk = now
            if now - last_beat >= 1.0:
                self.send({"type": "beat", "t": round(time.time(), 3)})
                last_beat = now
            self.flush()


def discover_shards(run_dir: str) -> list[int]:
    """The shards that have ever been launched on this host (their folders exist)."""
    folder = os.path.join(run_dir, "shards")
    if not os.path.isdir(folder):
        return []
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit())


def _thin_progress(events: list[dict]) -> list[dict]:
    """Keep every event but the older progress ones (a long run has thousands)."""
    progress_idx = [i for i, e in enumerate(events) if e.get("event") == protocol.PROGRESS]
    drop = set(progress_idx[:-REPLAY_PROGRESS_KEPT])
    return [e for i, e in enumerate(events) if i not in drop]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.agent")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--shards", required=True,
                    help="comma list of shard ids on this host, or auto (every shard folder)")
    ap.add_argument("--output", default=None)
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--gpu-interval", type=float, default=1.0)
    ap.add_argument("--sentinels", default=None, help="JSON: done, fail, progress, progress_glob, total")
    ap.add_argument("--once", action="store_true")
    args = ap.parse_args(argv)
    shards = discover_shards(args.run_dir) if args.shards == "auto" else \
        [int(x) for x in args.shards.split(",") if x]
    agent = Agent(args.run_dir, shards, args.output, json.loads(args.sentinels) if args.sentinels else None)
    try:
        if args.once:
            agent.once()
            return 0
        stop = threading.Event()

        def watch_stdin() -> None:          # the channel closing closes our stdin
            try:
                while sys.stdin.buffer.read(4096):
                    pass
            except OSError:
                pass
            stop.set()
        threading.Thread(target=watch_stdin, daemon=True).start()
        agent.follow(args.interval, args.gpu_interval, stop)
    except (BrokenPipeError, KeyboardInterrupt):
        pass
    finally:
        try:
            sys.stdout.close()
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
