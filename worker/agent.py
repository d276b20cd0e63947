"""`python -m worker.agent`: the supervisor's eyes on one host, streamed as typed messages.

It replays each shard's events.jsonl from the start (so a supervisor that reconnects rebuilds its
state from the host's own record), then follows it; reports each shard's liveness (its lock) so an
exit is noticed within one poll; reads GPU telemetry and free disk. It derives nothing from logs:
the runner records a [job]'s sentinels itself. The one thing it writes is the end of a launch whose
runner died without recording it (`exited`, `vanished`), under the shard's lock so no launch can
race it. It exits when its stdin closes or its stdout breaks, that is, with the SSH channel; the
workers do not. An error it cannot go on from is sent as an `error` message before it exits.

Standard library only (pynvml when present). It reads only the run's own folders.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import sys
import threading
import time
import traceback

from . import protocol
from .gpu import GpuReader
from .hostctl import is_running, read_pid
from .plan import read_plan
from .probe import disk_space

REPLAY_RECENT_S = 120.0           # progress events kept in full on replay (rates need 30 s)
REPLAY_BUCKET_S = 60.0            # older progress: one per minute (the throughput chart)


class ShardFollower:
    """One shard's record: the byte offset read so far, and whether its newest launch has ended."""

    def __init__(self, shard_dir: str):
        self.dir = shard_dir
        self.events_path = os.path.join(shard_dir, protocol.EVENTS_FILE)
        self.offset = 0
        self.launch = 0
        self.ended = True
        self.alive: bool | None = None

    def read(self) -> list[dict]:
        records, self.offset = protocol.read_jsonl_from(self.events_path, self.offset)
        for raw in records:
            ev = protocol.parse_event(raw)
            if isinstance(ev, protocol.Launch):
                self.launch, self.ended = ev.launch, False
            elif isinstance(ev, protocol.Exited) and ev.launch in (None, self.launch):
                self.ended = True
        return records

    def end_vanished(self) -> list[dict]:
        """The lock is free but the newest launch has no end: its runner died with it. Append the
        end under an exclusive lock (no launch can start meanwhile) and return what was read."""
        try:
            fd = os.open(os.path.join(self.dir, protocol.LOCK_FILE), os.O_RDWR)
        except OSError:
            return []
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:              # a launch holds it now: nothing vanished
            os.close(fd)
            return []
        try:
            events = self.read()
            if not self.ended:
                protocol.append_jsonl(self.events_path, protocol.Exited(launch=self.launch, vanished=True))
                events += self.read()
            return events
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class Agent:
    def __init__(self, run_dir: str, shards: list[int], output: str | None, out=sys.stdout):
        self.run_dir = run_dir
        self.output = output
        self.out = out
        self.shards = {k: ShardFollower(protocol.shard_dir(run_dir, k)) for k in shards}
        self.gpus = GpuReader()

    def send(self, message: protocol.Message) -> None:
        self.out.write(message.to_json() + "\n")

    def flush(self) -> None:
        self.out.flush()

    def poll_shards(self, replay: bool = False, force_liveness: bool = False) -> None:
        """Liveness first, then the record: the runner writes `exited` before the lock goes, so a
        shard seen dead here has its end in what is read next (or the agent records it)."""
        for k, f in self.shards.items():
            alive = is_running(f.dir)
            events = f.read()
            if not alive and not f.ended and f.launch:
                events += f.end_vanished()
            if replay:
                events = thin_progress(events)
            for raw in events:
                self.send(protocol.EventMessage(shard=k, event=raw))
            if force_liveness or alive != f.alive:
                f.alive = alive
                self.send(protocol.Liveness(shard=k, alive=alive, pid=read_pid(f.dir) if alive else None))

    def poll_gpu(self) -> None:
        self.send(protocol.GpuReading(source=self.gpus.source, gpus=self.gpus.read(), error=self.gpus.error))

    def poll_disk(self) -> None:
        if not self.output:
            return
        try:
            d = disk_space(self.output)
            self.send(protocol.DiskReading(path=self.output, free=d.free, total=d.total))
        except OSError as e:
            self.send(protocol.DiskReading(path=self.output, error=e.strerror))

    def replay(self) -> None:
        """hello, every shard's record so far with its liveness, GPUs, disk, then `replayed`."""
        self.send(protocol.Hello(host=socket.gethostname(), pid=os.getpid(), plan=read_plan(self.run_dir)))
        self.poll_shards(replay=True, force_liveness=True)
        self.poll_gpu()
        self.poll_disk()
        self.send(protocol.Replayed())

    def once(self) -> None:
        self.replay()
        self.send(protocol.End())
        self.flush()

    def follow(self, interval: float, gpu_interval: float, stop: threading.Event) -> None:
        self.replay()
        self.flush()
        last_gpu = last_disk = last_beat = time.monotonic()
        while not stop.wait(interval):
            self.poll_shards()
            now = time.monotonic()
            if now - last_gpu >= gpu_interval:
                self.poll_gpu()
                last_gpu = now
            if now - last_disk >= 5 * gpu_interval:
                self.poll_disk()
                last_disk = now
            if now - last_beat >= 1.0:
                self.send(protocol.Beat())
                last_beat = now
            self.flush()


def discover_shards(run_dir: str) -> list[int]:
    """The shards that have ever been launched on this host (their folders exist)."""
    folder = os.path.join(run_dir, "shards")
    if not os.path.isdir(folder):
        return []
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit())


def thin_progress(events: list[dict]) -> list[dict]:
    """On replay, keep every event but older progress: all of the last REPLAY_RECENT_S (rates are
    computed from them exactly as live), one a minute before that (the chart), and the newest."""
    times = [float(e.get("t", 0)) for e in events if e.get("event") == protocol.Progress.KIND]
    if not times:
        return events
    newest = max(times)
    out, buckets, last_i = [], set(), max(i for i, e in enumerate(events)
                                          if e.get("event") == protocol.Progress.KIND)
    for i, e in enumerate(events):
        if e.get("event") == protocol.Progress.KIND and i != last_i:
            t = float(e.get("t", 0))
            if t < newest - REPLAY_RECENT_S:
                bucket = int(t // REPLAY_BUCKET_S)
                if bucket in buckets:
                    continue
                buckets.add(bucket)
        out.append(e)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.agent")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--shards", required=True,
                    help="comma list of shard ids on this host, or auto (every shard folder)")
    ap.add_argument("--output", default=None)
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--gpu-interval", type=float, default=1.0)
    ap.add_argument("--once", action="store_true")
    args = ap.parse_args(argv)
    agent = None
    try:
        shards = discover_shards(args.run_dir) if args.shards == "auto" else \
            [int(x) for x in args.shards.split(",") if x]
        agent = Agent(args.run_dir, shards, args.output)
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
    except Exception as e:                  # say why, on the channel the supervisor reads
        traceback.print_exc(file=sys.stderr)
        try:
            sys.stdout.write(protocol.AgentError(message=f"{type(e).__name__}: {e}").to_json() + "\n")
            sys.stdout.flush()
        except OSError:
            pass
        return 1
    finally:
        try:
            sys.stdout.close()
        except OSError:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
