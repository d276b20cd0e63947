"""`python -m worker.agent`: the supervisor's eyes on one host, streamed as typed messages.

It replays each shard's events.jsonl from the start (so a supervisor that reconnects rebuilds its
state from the host's own record), then follows it; reports each shard's liveness (its lock) so an
exit is noticed within one poll; reads GPU telemetry and free disk. It derives nothing from logs:
the runner records a [job]'s sentinels itself. The one thing it writes is the end of a launch whose
runner died without recording it (`exited`, `vanished`), under the shard's lock so no launch can
race it. It exits when its stdin closes or its stdout breaks, that is, with the SSH channel; the
workers do not. An error it cannot go on from is sent as an `error` message before it exits.

Under an engine that queues tasks (`--engine NAME`, on its login node; worker/engine/) liveness
is the engine's: a shard is alive while the engine holds its newest launch's task (queued or
running), asked every `--engine-interval` (every second while a task is ending or its final word is
still to be read). Each live task's state is sent as it changes (`task`: queued and the reason,
running and the node); a task's final word is recorded in its shard's record once (`task_end`, with
`exited` when the task never recorded its end), so a replay judges it the same after the engine has
forgotten the task. GPUs are the tasks' own readings from their folders (`task_gpus`), not this node's.

Standard library only (pynvml when present). It reads only the run's own folders.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

from . import claim, protocol
from .engine import load as load_engine
from .engine.tasks import Engine, EngineError, RunLock, View, record_end, settle_unended
from .gpu import GpuReader
from .hostctl import is_acting, is_running, read_pid
from .launches import LaunchState
from .plan import read_plan
from .probe import disk_space

REPLAY_RECENT_S = protocol.REPLAY_RECENT_S   # progress kept in full on replay (rates need 30 s; LATE its gaps)
REPLAY_BUCKET_S = 60.0            # older progress: one per minute (the throughput chart)
ENGINE_URGENT_S = 1.0             # the engine's poll interval while a task is ending or its end is unread
ENGINE_END_WINDOW_S = 600.0       # a launch that ended this recently still gets the engine's final word
IDLE_EVERY_S = 1.0                # how often a live shard's idle time is sent
CLAIM_TTL_S = 300.0               # a claiming agent's supervisor silent on stdin this long: gone


class ShardFollower:
    """One shard's record: the byte offset read so far, and whether its newest launch has ended."""

    def __init__(self, shard_dir: str):
        self.dir = shard_dir
        self.events_path = os.path.join(shard_dir, protocol.EVENTS_FILE)
        self.tail = protocol.JsonlTail(self.events_path)
        self.damage_sent: tuple | None = None   # (bad bytes, bad lines) as last told
        self.launch = 0
        self.ended = True
        self.alive: bool | None = None
        self.acting: bool | None = None
        self.progress_mono: float | None = None   # monotonic time of the newest launch's last progress
        self.idle_sent = 0.0
        self.state = LaunchState()            # the newest launch as an engine's task matters to it
        self.end_t: float | None = None       # host time the newest launch ended
        self.job_seen = 0.0                   # monotonic time its task was first read
        self.final_checked = False            # the engine's final word on an ended launch was looked for
        self.sent_view: tuple | None = None
        self.gpus_mtime: float | None = None

    def read(self) -> list[protocol.Event]:
        """The record's new events, typed (a line that is no event this side knows is passed over)."""
        records = [ev for ev in map(protocol.parse_event, self.tail.read()) if ev is not None]
        for ev in records:
            job = self.state.job
            self.state.apply(ev)
            if self.state.job != job:
                self.job_seen = time.monotonic()
            if isinstance(ev, protocol.Launch):
                self.launch, self.ended, self.end_t, self.final_checked = ev.launch, False, None, False
            elif isinstance(ev, protocol.Exited) and ev.launch in (None, self.launch):
                self.ended, self.end_t = True, self.end_t or ev.t
            if isinstance(ev, protocol.PROGRESS_EVENTS) and (ev.launch in (None, self.launch)):
                # When it happened, on the monotonic clock: now, less how old its stamp says it is
                # (a replayed event); a stamp from the future (the wall clock stepped back) is now.
                self.progress_mono = time.monotonic() - min(max(protocol.now() - ev.t, 0.0), 1e9)
        return records

    def damage(self, k: int, replay: bool) -> protocol.RecordDamage | None:
        """What of its record is unreadable, when that changed (or on a replay, when any is)."""
        t = self.tail
        now = (t.bad_bytes, t.bad_lines)
        if now == (0, 0) or (now == self.damage_sent and not replay):
            return None
        self.damage_sent = now
        return protocol.RecordDamage(shard=k, bad_bytes=t.bad_bytes, bad_lines=t.bad_lines,
                                     after_line=t.bad_after or 0)

    def idle_s(self) -> float | None:
        return None if self.progress_mono is None else round(time.monotonic() - self.progress_mono, 2)

    def end_vanished(self) -> list[protocol.Event]:
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
                try:
                    protocol.append_jsonl(self.events_path, protocol.Exited(launch=self.launch, vanished=True))
                except OSError:                 # a full state disk: try again at the next poll
                    return events
                events += self.read()
            return events
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class TaskWatch:
    """The agent's view of the run's tasks: one question to the engine for all of them when due, in
    a thread of its own, so a slow controller never silences the agent (the supervisor takes five
    silent seconds for a dead link)."""

    def __init__(self, engine: Engine, interval: float):
        self.engine = engine
        self.interval = interval
        self.views: dict[str, View] = {}
        self.began = -1e18                 # monotonic time the last answered query began
        self.last_try = -1e18
        self.error: str | None = None
        self.sent_error: tuple[str | None] | None = None
        self.urgent = False
        self._thread: threading.Thread | None = None
        self._answer: tuple[float, dict[str, View] | None, str | None] | None = None

    def _ask(self, jobs: list[str], began: float) -> None:
        try:
            self._answer = (began, self.engine.views_of(jobs) if jobs else {}, None)
        except EngineError as e:
            self._answer = (began, None, str(e))
        except Exception as e:                 # never lose the thread's answer to a surprise
            self._answer = (began, None, f"{type(e).__name__}: {e}")

    def poll(self, jobs: list[str], force: bool, beat: Callable[[], None] | None = None) -> bool:
        """Start a query if one is due (`force`: now, and wait for it, calling `beat` each second);
        True when an answer came in (views are then fresh for what was read before `began`)."""
        now = time.monotonic()
        due = self.interval if not self.urgent else min(self.interval, ENGINE_URGENT_S)
        if self._thread is None and (force or now - self.last_try >= due):
            self.last_try = now
            self._answer = None
            self._thread = threading.Thread(target=self._ask, args=(jobs, now), daemon=True)
            self._thread.start()
        if self._thread is None:
            return False
        while force and self._thread.is_alive():
            self._thread.join(1.0)
            if beat is not None and self._thread.is_alive():
                beat()
        if self._thread.is_alive():
            return False
        self._thread = None
        assert self._answer is not None        # _ask answers before its thread ends
        began, views, error = self._answer
        self.error = error
        if views is None:
            return False
        self.views, self.began = views, began
        return True


class Agent:
    def __init__(self, run_dir: str, shards: list[int], output: str | None, out=sys.stdout,
                 engine: Engine | None = None, engine_interval: float = 5.0):
        self.run_dir = run_dir
        self.output = output
        self.out = out
        self.shards = {k: ShardFollower(protocol.shard_dir(run_dir, k)) for k in shards}
        self.tasks = TaskWatch(engine, engine_interval) if engine is not None else None
        self.gpus = GpuReader() if self.tasks is None else None

    def send(self, message: protocol.Message) -> None:
        self.out.write(message.to_json() + "\n")

    def flush(self) -> None:
        self.out.flush()

    def poll_shards(self, replay: bool = False, force_liveness: bool = False) -> None:
        """Liveness first, then the record: the runner writes `exited` before the lock goes, so a
        shard seen dead here has its end in what is read next (or the agent records it)."""
        if self.tasks is not None:
            self.poll_task_shards(replay, force_liveness)
            return
        idle: dict[int, float] = {}          # live shards whose life did not change: one line
        for k, f in self.shards.items():
            acting = is_acting(f.dir)          # before the record: an action seen idle here has
            alive = is_running(f.dir)          # its launch, if it made one, in what is read next
            events = f.read()
            if not alive and not f.ended and f.launch:
                events += f.end_vanished()
            if replay:
                events = thin_progress(events)
            for ev in events:
                self.send(protocol.EventMessage(shard=k, event=ev))
            if (damage := f.damage(k, replay)) is not None:
                self.send(damage)
            if force_liveness or (alive, acting) != (f.alive, f.acting):
                f.alive, f.acting, f.idle_sent = alive, acting, time.monotonic()
                self.send(protocol.Liveness(shard=k, alive=alive, pid=read_pid(f.dir) if alive else None,
                                            acting=acting, idle_s=f.idle_s() if alive else None))
            elif alive and time.monotonic() - f.idle_sent >= IDLE_EVERY_S:
                f.idle_sent = time.monotonic()
                if (idle_s := f.idle_s()) is not None:         # (no progress yet: nothing to say)
                    idle[k] = idle_s
        if idle:
            self.send(protocol.Idle(shards=list(idle), idle_s=list(idle.values())))

    def poll_task_shards(self, replay: bool, force_liveness: bool) -> None:
        """The record first, then the engine: a task's end is only concluded from a query that
        began after its task was read, and its record is read again before anything is written."""
        watch = self.tasks
        assert watch is not None               # (called only with an engine: poll_shards)
        events = {k: f.read() for k, f in self.shards.items()}
        self._close_final_checks(protocol.now())
        wanted = [f.state.job for f in self.shards.values() if f.state.job and (not f.ended or not f.final_checked)]
        answered = watch.poll(wanted, force=replay, beat=self._beat)
        if replay or (watch.error,) != watch.sent_error:
            watch.sent_error = (watch.error,)
            self.send(protocol.EnginePoll(error=watch.error, engine=watch.engine.label))
        for k, f in self.shards.items():
            view = watch.views.get(f.state.job) if f.state.job else None
            events[k] += self._record_task_end(f, view, answered)
            self._send_task_shard(k, f, view, thin_progress(events[k]) if replay else events[k],
                                   replay, force_liveness)
        watch.urgent = any(v.phase == "ending" for v in watch.views.values()) or \
            any(f.state.job and not f.final_checked for f in self.shards.values() if f.ended)

    def _close_final_checks(self, now_host: float) -> None:
        """An ended launch whose final word from the engine is not worth waiting for any more."""
        for f in self.shards.values():
            if f.ended and (not f.state.queued or f.state.task_ended or f.state.job is None
                            or f.end_t is None or now_host - f.end_t > ENGINE_END_WINDOW_S):
                f.final_checked = True

    def _record_task_end(self, f: ShardFollower, view: View | None, answered: bool) -> list[protocol.Event]:
        """What the engine's answer adds to a shard's record: a submission whose submitter died, or
        the final word on a task that ended (from a query that began after its task was read)."""
        state, watch = f.state, self.tasks
        assert watch is not None
        fresh = answered and f.job_seen < watch.began
        if state.queued and not f.ended and state.job is None and answered:
            return self._settle_submission(f)
        if view is not None and view.terminal and fresh and (not f.ended or not f.final_checked):
            if f.ended and view.end not in protocol.ENGINE_ENDED:
                f.final_checked = True            # the task's own end says it all
            elif self._under_run_lock(lambda: record_end(f.dir, view, watch.engine.label)):
                f.final_checked = True
                return f.read()
        return []

    def _send_task_shard(self, k: int, f: ShardFollower, view: View | None, events: list[protocol.Event],
                         replay: bool, force_liveness: bool) -> None:
        """A shard's new events, its liveness as the engine sees it, its task and the task's GPUs."""
        state = f.state
        for ev in events:
            self.send(protocol.EventMessage(shard=k, event=ev))
        if (damage := f.damage(k, replay)) is not None:
            self.send(damage)
        alive = bool(state.n) and not f.ended and (view is None or view.live)
        if force_liveness or alive != f.alive:
            f.alive = alive
            self.send(protocol.Liveness(shard=k, alive=alive, pid=read_pid(f.dir) if alive else None))
        key = (state.n, view) if alive and view is not None else None
        if alive and view is not None and (replay or key != f.sent_view):     # (when key is not None)
            self.send(protocol.TaskState(shard=k, launch=state.n, job=view.job, phase=view.phase,
                                         state=view.state, reason=view.reason, node=view.node))
        f.sent_view = key
        if alive and view is not None and view.phase == "running":
            self._task_gpus(k, f, replay)

    def _beat(self) -> None:
        self.send(protocol.Beat())
        self.flush()

    def _under_run_lock(self, write) -> bool:
        """Write into a record only while no submission or cancellation of the run is under way
        (they record the same ends themselves); False when one is: try again next time."""
        lock = RunLock(self.run_dir)
        if not lock.acquire(wait=0):
            return False
        try:
            write()
            return True
        finally:
            lock.release()

    def _settle_submission(self, f: ShardFollower) -> list[protocol.Event]:
        """A launch that has no task while no submission holds the run's lock: its submitter died
        before the engine answered. Recorded as a failed launch (under the lock, after re-reading)."""
        assert self.tasks is not None
        label = self.tasks.engine.label

        def settle():
            state = LaunchState.read(f.events_path)
            if not state.ended and state.job is None:
                settle_unended(f.dir, state, {}, label)
        return f.read() if self._under_run_lock(settle) else []

    def _task_gpus(self, k: int, f: ShardFollower, replay: bool) -> None:
        path = os.path.join(f.dir, protocol.GPUS_FILE)
        try:
            mtime = os.stat(path).st_mtime
            if mtime == f.gpus_mtime and not replay:
                return
            with open(path) as fh:
                r = json.load(fh)
        except (OSError, ValueError):
            return
        f.gpus_mtime = mtime
        try:
            reading = protocol.TaskGpus.from_dict(r) if isinstance(r, dict) else None
        except (TypeError, ValueError):       # a file this side cannot read: no reading
            reading = None
        if reading is not None and reading.launch == f.state.n:
            reading.shard = k
            self.send(reading)

    def poll_gpu(self) -> None:
        if self.gpus is None:                   # an engine's tasks report their own GPUs
            return
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
        plan = read_plan(self.run_dir)
        self.send(protocol.Hello(host=socket.gethostname(), pid=os.getpid(), plan=plan,
                                 host_id=read_host_id(self.run_dir)))
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


def watch_stdin(stop: threading.Event, ttl: float | None) -> None:
    """Stop the agent when its stdin closes (the channel did), or (`ttl`) once nothing came on it
    for that long: a supervisor that holds the run writes a line every few seconds, so one that
    went away behind a channel still open lets go of the run. An agent blocked writing to such a
    channel is ended here too (os._exit): the claim's lock goes with the process."""
    import select
    fd = sys.stdin.fileno()
    heard = time.monotonic()
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if ready:
                if not os.read(fd, 4096):
                    break
                heard = time.monotonic()
            elif ttl is not None and time.monotonic() - heard > ttl:
                os._exit(0)
    except (OSError, ValueError):
        pass
    stop.set()


def read_host_id(run_dir: str) -> str | None:
    """The machine's identity file under the host's root (preflight writes it; this only reads)."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(run_dir)), "host-id")) as f:
            return f.read().strip() or None
    except OSError:
        return None


def discover_shards(run_dir: str) -> list[int]:
    """The shards that have ever been launched on this host (their folders exist)."""
    folder = os.path.join(run_dir, "shards")
    if not os.path.isdir(folder):
        return []
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit())


def thin_progress(events: list[protocol.Event]) -> list[protocol.Event]:
    """On replay, keep every event but older progress: all of the last REPLAY_RECENT_S (rates are
    computed from them exactly as live), one a minute before that (the chart), and the newest."""
    ticks = [i for i, e in enumerate(events) if type(e) is protocol.Progress]    # not Done: its subclass
    if not ticks:
        return events
    newest, last_i = max(events[i].t for i in ticks), ticks[-1]
    out, buckets = [], set()
    for i, e in enumerate(events):
        if type(e) is protocol.Progress and i != last_i and e.t < newest - REPLAY_RECENT_S:
            bucket = int(e.t // REPLAY_BUCKET_S)
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
    ap.add_argument("--engine", default=None, help="the shards are this engine's tasks (worker/engine/): "
                    "liveness and final states are the engine's")
    ap.add_argument("--engine-options", default="{}", help="the engine's section of fleet.toml, as JSON")
    ap.add_argument("--engine-interval", type=float, default=5.0, help="seconds between questions to the engine")
    ap.add_argument("--claim", default=None, help="hold the run for this supervisor (a SupervisorClaim's "
                    "JSON): worker/claim.py")
    ap.add_argument("--take-over", action="store_true", help="with --claim: end the agent that holds it")
    ap.add_argument("--claim-ttl", type=float, default=CLAIM_TTL_S,
                    help="with --claim: exit after this many seconds without a line on stdin")
    args = ap.parse_args(argv)
    agent = None
    try:
        shards = discover_shards(args.run_dir) if args.shards == "auto" else \
            [int(x) for x in args.shards.split(",") if x]
        engine = load_engine(args.engine, json.loads(args.engine_options)) if args.engine else None
        agent = Agent(args.run_dir, shards, args.output, engine=engine, engine_interval=args.engine_interval)
        if args.once:
            agent.once()
            return 0
        if args.claim is not None:
            held = claim.take(args.run_dir, protocol.SupervisorClaim.from_dict(json.loads(args.claim)),
                              args.take_over)
            if isinstance(held, protocol.SupervisorClaim):      # another supervisor's: say whose
                agent.send(protocol.Claimed(holder=held))
                agent.flush()
                return 0
        stop = threading.Event()
        ttl = args.claim_ttl if args.claim is not None else None
        threading.Thread(target=watch_stdin, args=(stop, ttl), daemon=True).start()
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
