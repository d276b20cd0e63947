"""What both sides say the same way: a command's last line, how a process ended, a byte count,
runs of indices ("0-2,5,7-8").

Standard library only (it travels to every host and `fleet` imports it): the one home of value
formatting that the worker can import; `fleet/units.py` builds the supervisor's figures (durations,
rates, dollars, GiB) on top of it, so a host's preflight and the supervisor never write one size
or one set of rows two ways.
"""

from __future__ import annotations

import re
from typing import Any, Iterable

from .ranges import to_runs

UNKNOWN = "?"

# What a host's text must not carry to a person's terminal: escape sequences whole (CSI, OSC and
# the other string controls, in their ESC and their one-code-point C1 forms: a title, the
# clipboard, a cleared screen), then any other C0 control but tab, DEL, C1 controls, and the
# bidirectional marks, embeddings, overrides and isolates that reorder what is read.
_SEQUENCE = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
                       r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                       r"|\x1b[ -~]?")
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


# Every code point the two above can take out (each sequence begins with one): text with none of
# them is printable as it is — most of a host's text, looked at once instead of rewritten twice.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` from a host as data, never terminal control: its control sequences and characters
    and bidi overrides removed (a line break becomes a space)."""
    if _UNSAFE.search(text) is None:
        return text
    return _CONTROL.sub("", _SEQUENCE.sub("", text.replace("\r\n", " ").replace("\n", " ")))


def plain_json(line: str) -> bool:
    """A JSON line no string of which needs `printable`: no escape (a control character can only
    come escaped) and no code point it takes out. The supervisor reads ~250 such lines a second
    at 64 hosts; only the rest go through printable_data."""
    return "\\" not in line and _UNSAFE.search(line.rstrip("\n")) is None


def printable_data(obj: Any) -> Any:
    """Every string in a host's JSON (keys too) made printable."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, list):
        return [printable_data(x) for x in obj]
    if isinstance(obj, dict):
        return {printable(k) if isinstance(k, str) else k: printable_data(v) for k, v in obj.items()}
    return obj


def last_line(text: str, limit: int = 300) -> str:
    """The last non-blank line of a command's output (what a one-line error quotes)."""
    lines = [l.strip() for l in printable_lines(text) if l.strip()]
    return lines[-1][:limit] if lines else "(no output)"


def printable_lines(text: str) -> list[str]:
    """A command's output as printable lines."""
    return [printable(line) for line in text.splitlines()]


def exit_words(code: int | None) -> str:
    """How a process ended, from its exit status (negative: the signal that killed it)."""
    if code is None:
        return "ended without an exit status"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exited with code {code}"


def bytes_text(n: float | None, digits: int = 1) -> str:
    """1234567 -> '1.2 MB' (decimal units, as disks are sold: B, kB, MB, GB, TB, PB)."""
    if n is None:
        return UNKNOWN
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1000
    return UNKNOWN


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50}


def parse_bytes(text: str | int) -> int:
    """'200GB' -> 200_000_000_000 (decimal kB..PB as `bytes_text` writes them, binary KiB..PiB, or
    a plain count); ValueError naming what was given otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"{text}: a size is not negative")
        return text
    import re
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r}: a size such as \"200GB\", \"1.5TB\" or \"500GiB\"")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def runs_text(runs: Iterable[Iterable[int]], sep: str = ",") -> str:
    """[[0, 3), [5, 6), [7, 9)] -> "0-2,5,7-8" (inclusive ends, as people and Slurm write them)."""
    return sep.join(f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in runs)


def parse_runs_text(text: str) -> list[tuple[int, int]]:
    """"0-2,5,7-8" -> [(0, 3), (5, 6), (7, 9)]: the inverse of runs_text. Raises ValueError."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, _, b = part.partition("-")
        out.append((int(a), int(b or a) + 1))
    return out


def ranges_text(indices: Iterable[int], sep: str = ",") -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    return runs_text(to_runs(indices), sep)
