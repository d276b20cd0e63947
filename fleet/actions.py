"""What may be done to a shard, and the typed action that does it: one rule for every caller.

The policy (the judge's verdict), the TUI's keys (r, R, k, D, :restart, :stop) and the shell's
`fleet restart` / `fleet down` all end here, then in the launcher's one door on the host. Pure.

Invariants (tests/fleet/test_actions.py drives them through real processes):
- at most one live process per shard (the host's lock, and `expect_launch` for every launch);
- no live process in DONE, FATAL or STOPPED (FATAL stops what is left first);
- a user's stop is never undone by the policy (the host refuses a policy launch where it stands);
- a hung shard is restarted every time until `max_restarts`, then FATAL;
- the same rules for every caller (`refusal`), and a user's restart is never counted as a failure.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker import protocol

from .judge import Action, Verdict
from .record import ShardRecord
from .state import State

# Results that mean the action is under way: the shard stays busy until its record shows it.
UNDER_WAY = frozenset({"started", "submitted", "refused", "stopping", "restarting", "done"})

KINDS = ("restart", "stop")


def refusal(kind: str, state: State, shard: int, verifiable: bool = True, why: str | None = None) -> str | None:
    """Why the user's `kind` (restart | stop) cannot apply to a shard in `state`; None if it can
    (`verifiable`: the built-in worker's, whose files `fleet verify` checks; not a [job]'s; `why`:
    the verdict's reason, which an UNKNOWN refusal repeats as the screen shows it)."""
    if state == State.UNKNOWN:
        return f"shard {shard}: {why or 'its host is unreachable'}"
    if state == State.STOPPING:
        return f"shard {shard} is already stopping"
    if kind == "restart" and state == State.DONE:
        return f"shard {shard} is DONE: nothing to redo" + (
            " (`fleet verify` checks its files, `fleet verify --repair` reopens the samples that are bad)"
            if verifiable else "")
    if kind == "stop" and state in (State.DONE, State.STOPPED):
        return f"shard {shard} is {state.value}: nothing to stop"
    return None


def newest_launch(record: ShardRecord) -> int:
    return record.attempt.n if record.attempt is not None else 0


def _start_kind(record: ShardRecord) -> str:
    """A restart of a shard whose newest attempt has ended is a launch (nothing to stop: the host
    refuses it if something runs after all); of a live one, a stop and then a launch."""
    a = record.attempt
    return "launch" if a is None or a.ended else "restart"


def policy_action(record: ShardRecord, verdict: Verdict, grace: float, shard: int) -> protocol.ShardAction | None:
    """The action the verdict makes due, as the host will carry it out (None: nothing due)."""
    n = newest_launch(record)
    if verdict.action == Action.LAUNCH:
        kind, why, by = "launch", "restart", "manual"
    elif verdict.action == Action.RESTART:
        kind, why, by = _start_kind(record), "restart", verdict.by
    elif verdict.action == Action.STOP:
        kind, why, by = "stop", "fatal", "auto"
    else:
        return None
    return protocol.ShardAction(shard=shard, kind=kind, why=why, by=by, reason=_reason(verdict),
                                expect_launch=n, grace=grace, policy=True)


def user_action(record: ShardRecord, kind: str, grace: float, shard: int) -> protocol.ShardAction:
    """The user's restart (by manual: a fresh restart budget, never a failure) or stop."""
    n = newest_launch(record)
    if kind == "stop":
        return protocol.ShardAction(shard=shard, kind="stop", why="user", grace=grace)
    return protocol.ShardAction(shard=shard, kind=_start_kind(record), why="restart", by="manual",
                                reason="restarted by the user", expect_launch=n, grace=grace)


def _reason(verdict: Verdict) -> str | None:
    """The failure a restart restarts from, without the verdict's own '; restart in 2s'."""
    if not verdict.reason:
        return None
    why = verdict.reason.split("; restart in")[0].split("; stopping what is left")[0]
    return why.split("; last: ", 1)[1] if why.startswith("gave up after") and "; last: " in why else why


def busy_mark(record: ShardRecord) -> tuple:
    """What changes in the record once an action has been carried out: a new launch or intent."""
    a = record.attempt
    stop = a.stop if a is not None else record.unlaunched_stop
    return (newest_launch(record), a.ended if a is not None else None,
            (stop.t, stop.why, stop.then) if stop else None)


def describe(r: protocol.ActResult) -> str:
    """One line for what an action did: 'shard 5: restarting', 'shard 2: refused: ... DONE ...'."""
    if r.status == "refused" and r.detail:
        return r.detail
    what = {"stale": "already acted on by another supervisor", "busy": "a stop or restart is under way",
            "done": r.detail or "done"}.get(r.status, r.status)
    if r.status not in ("stale", "busy", "done") and r.detail:
        what += f" ({r.detail})"
    return f"shard {r.shard}: {what}"


@dataclass(frozen=True)
class HostStop:
    """One host's part of a run stop (`Supervisor.stop_all`): each shard's outcome as its host
    reported it (stopped, killed, still running, not running…), or why the host could not be asked."""
    host: str
    shards: dict[int, str] = field(default_factory=dict)
    error: str | None = None

    @property
    def stopped(self) -> list[int]:
        return sorted(k for k, v in self.shards.items() if v in ("stopped", "killed"))

    @property
    def still_running(self) -> list[int]:
        return sorted(k for k, v in self.shards.items() if v == "still running")

    def text(self) -> str:
        """'box1: stopped 3 shard(s) (0, 1, 2)', with what is still running, or the host's error."""
        if self.error is not None:
            return f"{self.host}: {self.error}"
        stopped, left = self.stopped, self.still_running
        return (f"{self.host}: stopped {len(stopped)} shard(s)" + (f" ({', '.join(map(str, stopped))})" if stopped else "")
                + (f"; still running after SIGKILL: {', '.join(map(str, left))}" if left else ""))
