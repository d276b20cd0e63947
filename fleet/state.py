"""Shard states and the sets of them that mean something; every other module reads these.

`PENDING → STARTING → LOADING → RUNNING → DONE`, with QUEUED between PENDING and STARTING when
an engine queues the shard's task (submitted, waiting in the engine's queue; the reason is the
engine's: Priority, Resources, ...); off the happy path LATE (alive, running, silent past a few of its usual intervals between
progress events: a hang looks like one before stall_timeout acts), STALLED (alive, no progress for stall_timeout), FAILED (ended badly, or a
failure seen while it still runs), BACKOFF (waiting to be restarted), FATAL (gave up after
max_restarts), STOPPED (stopped on purpose: never restarted automatically), STOPPING (a stop or
restart is being carried out: SIGTERM sent, SIGKILL after the grace; for a restart, until the new
launch is recorded), UNKNOWN (its host is
unreachable: not measured, never shown as zero). DEPLOYING is the state of every shard while
`fleet up` deploys, before any record exists.
"""

from __future__ import annotations

from enum import Enum


class State(str, Enum):
    PENDING = "PENDING"
    QUEUED = "QUEUED"
    DEPLOYING = "DEPLOYING"
    STARTING = "STARTING"
    LOADING = "LOADING"
    RUNNING = "RUNNING"
    LATE = "LATE"
    STOPPING = "STOPPING"
    DONE = "DONE"
    STALLED = "STALLED"
    FAILED = "FAILED"
    BACKOFF = "BACKOFF"
    FATAL = "FATAL"
    STOPPED = "STOPPED"
    UNKNOWN = "UNKNOWN"


LIVE = frozenset({State.STARTING, State.LOADING, State.RUNNING, State.LATE, State.STALLED, State.STOPPING})
MEASURED = frozenset({State.RUNNING, State.LATE, State.STALLED})          # states whose rates count
SETTLED = frozenset({State.DONE, State.FATAL, State.STOPPED})  # nothing more happens by itself
FAULTY = frozenset({State.STALLED, State.FAILED, State.BACKOFF, State.FATAL, State.UNKNOWN})
RESTARTABLE = frozenset({State.FAILED, State.BACKOFF, State.FATAL})   # what `R` restarts

# Most to least urgent: the order states are counted in and sorted by on screen.
SEVERITY = ("FATAL", "FAILED", "STALLED", "UNKNOWN", "LATE", "BACKOFF", "STOPPING", "STARTING", "LOADING",
            "DEPLOYING", "RUNNING", "PENDING", "STOPPED", "DONE")
