"""How a shard of `python -m worker.extract` ends: the exceptions that say what kind of end it is,
and for each its failure event and exit code, so the judge knows whether a restart can help.
"""

from __future__ import annotations

import sys
import traceback
from types import FrameType

from . import protocol
from .data import DataError
from .events import EventLog
from .formats import FormatError
from .layers import LayerError
from .leases import LedgerError
from .model import ModelError
from .reference import CheckFailed
from .ship import ShipError
from .writer import DiskFullError, OwnerError

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TERMINATED = 143


class Terminated(Exception):
    """SIGTERM (`on_term`): a stop, a restart or Slurm's end, told as such, never as a crash."""


class NotRetryable(Exception):
    """A failure that a restart would meet again (the work is not the run's, too many rows
    skipped): the failure event says so, and the judge gives up at once."""


class ForeignOutput(NotRetryable):
    """The output folder holds another run's work: nothing is written into it, not even the note
    that this shard stopped (that run's verify would read it as its own shard's)."""


def on_term(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a stop, a restart, Slurm's end) as an exception: the shard ends through main's handler."""
    raise Terminated(f"terminated by signal {signum}")


def fail(log: EventLog, reason: str, code: int, tb: str = "", fatal: bool = False) -> int:
    tail = tb.strip().splitlines()[-12:] if tb else []
    log.emit(protocol.Failed(reason=reason, exit_code=code, traceback=tail, fatal=fatal))
    print(f"error: shard {log.shard}: {reason}", file=sys.stderr, flush=True)
    return code


def failure_exit(log: EventLog, e: BaseException) -> int:
    """The failure event and exit code for what ended the shard: fatal where a restart would fail
    the same way (exit 1), a user's error (exit 2), a stop (143; quiet when one was asked for)."""
    if isinstance(e, (NotRetryable, CheckFailed, OwnerError, LedgerError)):   # (a restart reads the same)
        return fail(log, str(e), EXIT_FAILED, fatal=True)
    if isinstance(e, (DataError, ModelError, LayerError, FormatError, ShipError)):
        return fail(log, str(e), EXIT_USAGE, fatal=getattr(e, "fatal", False))
    if isinstance(e, DiskFullError):
        return fail(log, str(e), EXIT_FAILED)
    if isinstance(e, Terminated):
        if asked := log.stop_requested():
            print(f"stopped: {e} ({'a restart' if asked.why == 'restart' else 'asked by the user'}); "
                  f"what was written stays, the next launch resumes", file=sys.stderr, flush=True)
            return EXIT_TERMINATED
        return fail(log, str(e), EXIT_TERMINATED)
    if isinstance(e, KeyboardInterrupt):
        return fail(log, "interrupted", EXIT_TERMINATED)
    why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if "CUDA error" in str(e):        # sticky: only a new process recovers (worker.suspects)
        why += " (the rows in flight run alone, after the rest, at the next launch)"
    return fail(log, why, EXIT_FAILED, traceback.format_exc())
