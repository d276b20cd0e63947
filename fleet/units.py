"""Every number a person reads, formatted in one place: bytes (decimal, as disks are sold), GPU
memory (GiB, as nvidia-smi counts it), durations, rates and dollars. `fleet status`, the live view,
preflight's projection and the notices all call these, so one figure never reads two ways.
An unknown figure is '?' everywhere."""

from __future__ import annotations

from worker.text import UNKNOWN, bytes_text  # noqa: F401  (bytes: one rule for both sides)


def gib(n: float | None, digits: int = 1) -> str:
    """Bytes in GiB, as nvidia-smi's MiB figures read (an H200 is ~141 GiB): GPU memory everywhere."""
    return UNKNOWN if n is None else f"{n / 2**30:.{digits}f}"


def duration(s: float | None) -> str:
    """Seconds as '45s', '12m05s', '3h07m', '2d04h'."""
    if s is None:
        return UNKNOWN
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def eta(s: float | None, rough: bool = False) -> str:
    """Seconds left as '12m05s', '~12m05s' while the pace behind it is short (`rough`)."""
    return UNKNOWN if s is None else ("~" if rough else "") + duration(s)


def ago(s: int) -> str:
    """'now', '-2h', '-5m', '-30s': a time axis' tick, in the largest unit that divides it."""
    return "now" if s == 0 else f"-{s // 3600}h" if s % 3600 == 0 else f"-{s // 60}m" if s % 60 == 0 else f"-{s}s"


def number(x: float | None, digits: int = 1) -> str:
    """A figure in full with thousands separators: '2,617.0'."""
    return UNKNOWN if x is None else f"{x:,.{digits}f}"


def si(x: float | None, digits: int = 1) -> str:
    """1234567 -> 1.2M: rates in a few cells."""
    if x is None:
        return UNKNOWN
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.{digits}f}{unit}"
    if x == int(x) or x >= 100:
        return f"{x:.0f}"                       # counts and large figures: no ".0"
    return f"{x:.{digits}f}"


def usd(x: float | None) -> str:
    if x is None:
        return UNKNOWN
    return f"${x:,.2f}" if x < 10 else f"${x:,.0f}"
