"""A shard's record as the host-side tools need it: the newest launch (its number, whether it
ended, its engine's task) and the stops recorded for each launch. One fold of `events.jsonl` for the
runner, `hostctl act`, the agent and an engine's submitter and watcher (the supervisor folds the same
events into its richer `fleet.record.ShardRecord`). Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import protocol


@dataclass
class LaunchState:
    n: int = 0                         # the newest launch (0: never launched)
    t: float = 0.0
    by: str | None = None              # who asked for it: manual (a person) | auto (the policy)
    ended: bool = True
    queued: bool = False               # an engine queued it as a task (worker/engine/), not hostctl
    job: str | None = None
    task_ended: bool = False           # the engine's final word on its task is recorded
    last_stop: protocol.StopRequested | None = None          # the newest stop of any launch
    stops: dict[int, protocol.StopRequested] = field(default_factory=dict)   # launch -> its newest stop
    final: set[int] = field(default_factory=set)             # launches a user's or the run's stop ends

    def apply(self, ev: protocol.Event) -> None:
        if isinstance(ev, protocol.StopRequested):      # a stop names its launch (0: before the first)
            k = ev.launch or 0
            self.last_stop, self.stops[k] = ev, ev
            if ev.final:
                self.final.add(k)
        elif isinstance(ev, protocol.Launch):
            self.n, self.t, self.ended, self.by = ev.launch, ev.t, False, ev.by
            self.queued, self.job, self.task_ended = ev.launcher is not None, None, False
        elif ev.launch is not None and ev.launch != self.n:
            return
        elif isinstance(ev, protocol.Submitted) or (isinstance(ev, protocol.Started) and ev.job):
            self.job = self.job or ev.job
        elif isinstance(ev, protocol.TaskEnded):
            self.task_ended = True
        elif isinstance(ev, protocol.Exited):
            self.ended = True

    @property
    def user_stopped(self) -> bool:
        """A user's (or the run's) stop stands for the newest launch (or before the first one):
        only the user starts it again."""
        return self.n in self.final

    def stop_of(self, launch: int) -> protocol.StopRequested | None:
        return self.stops.get(launch)

    @classmethod
    def read(cls, events_path: str) -> LaunchState:
        state = cls()
        for ev in protocol.read_events(events_path):
            state.apply(ev)
        return state
