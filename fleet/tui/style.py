"""How things look: state glyphs and styles (with and without colour), meter bars with thresholds,
sparklines, and the units the panes print. Pure functions of values the snapshot computed; no
decisions about the fleet are made here.

Every state has a glyph, so a state reads without colour (NO_COLOR, colour-blind users, a
monochrome capture); under NO_COLOR, weight and reverse video carry what colour would.
"""

from __future__ import annotations

from rich.style import Style

from ..bound import WAIT_FLOOR
from ..state import State

GLYPH = {
    "PENDING": "○", "DEPLOYING": "…", "STARTING": "◔", "LOADING": "◑", "RUNNING": "▶", "LATE": "◷",
    "DONE": "✓", "STALLED": "⚠", "FAILED": "✗", "BACKOFF": "↻", "FATAL": "✖", "STOPPED": "■",
    "STOPPING": "◼", "UNKNOWN": "?",
}
# Every badge at least 4.5:1 (WCAG AA) against the table's background, as Textual draws the
# colours (ANSI names through its ANSI theme): the greys, reds and magentas of the ANSI theme were
# 1.4-4.5:1, hence the explicit ones. On the selection bar a row drops its cells' colours for the
# bar's own (fleet/tui/panes/lines.py): green on blue was 2.2:1. tests/fleet/test_contrast.py
# measures every state on both.
_COLOUR = {
    "PENDING": "#9e9e9e", "DEPLOYING": "cyan", "STARTING": "cyan", "LOADING": "cyan",
    "RUNNING": "green", "LATE": "bold #ffaf00", "DONE": "bold green", "STALLED": "bold yellow", "FAILED": "bold #ff5f87",
    "BACKOFF": "yellow", "FATAL": "bold #ffffff on #a00000", "STOPPED": "italic",
    "STOPPING": "bold #e070e0", "UNKNOWN": "#e070e0",
}
_MONO = {                                  # what survives NO_COLOR: weight, italics, reverse video
    "PENDING": "", "DEPLOYING": "", "STARTING": "", "LOADING": "", "RUNNING": "", "DONE": "",
    "LATE": "bold", "STALLED": "bold", "FAILED": "bold", "BACKOFF": "bold", "FATAL": "bold reverse",
    "STOPPED": "italic", "STOPPING": "bold italic", "UNKNOWN": "italic",
}
_STATE_STYLES = {False: {k: Style.parse(v) for k, v in _COLOUR.items()},
                 True: {k: Style.parse(v) for k, v in _MONO.items()}}

ALERT = {False: {None: "", "ok": "green", "low": "bold yellow", "critical": "bold #ff5f5f"},   # (red: 4.4:1 in 256 colours)
         True: {None: "", "ok": "", "low": "bold", "critical": "bold reverse"}}
GOOD, WARN, BAD = "green", "yellow", "bold red"


def state_style(state: str, no_color: bool = False) -> Style:
    return _STATE_STYLES[no_color].get(state, Style())


def state_label(state: str) -> str:
    return f"{GLYPH.get(state, ' ')} {state}"


def level_style(level: str, no_color: bool) -> str:
    """GOOD / WARN / BAD as a style: colours, or under NO_COLOR nothing / bold / bold reverse."""
    if no_color:
        return {GOOD: "", WARN: "bold", BAD: "bold reverse"}[level]
    return level


# --- thresholds (nvitop's idea: a meter says at a glance whether to worry) ------------------------

def memory_level(fraction: float) -> str:
    """GPU memory: worry near full (the next long batch may not fit)."""
    return GOOD if fraction < 0.80 else WARN if fraction < 0.95 else BAD


def util_level(percent: float) -> str:
    """Utilisation: for extraction an idle GPU is the problem, a busy one is the goal."""
    return GOOD if percent >= 75 else WARN if percent >= 25 else BAD


def wait_level(share: float) -> str:
    """The share of the time the GPUs waited for the disk or the upload (fleet/bound.py)."""
    return GOOD if share < WAIT_FLOOR else WARN if share < 0.25 else BAD


def temp_level(celsius: float) -> str:
    """H100/H200 throttle from about 87 °C."""
    return GOOD if celsius < 75 else WARN if celsius < 85 else BAD


def power_level(watts: float, limit: float | None) -> str:
    """Against the enforced power limit when the host reports it."""
    if not limit:
        return GOOD
    return GOOD if watts < 0.9 * limit else WARN if watts < 0.98 * limit else BAD


# --- text shapes -----------------------------------------------------------------------------------

_EIGHTHS = " ▏▎▍▌▋▊▉"
_SPARK = "▁▂▃▄▅▆▇█"


def bar(fraction: float, width: int, empty: str = "·") -> str:
    """A horizontal meter of `width` cells, eighths for the partial cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = int(round(fraction * width * 8))
    full, part = divmod(eighths, 8)
    partial = _EIGHTHS[part] if part else ""
    return ("█" * full + partial).ljust(width, empty)[:width]


def spark(values, width: int, top: float | None = None) -> str:
    """The last `width` values as a one-line sparkline (0 at the bottom, `top` or the max at the top)."""
    values = list(values)[-width:]
    if not values:
        return " " * width
    top = top or max(values) or 1.0
    return "".join(_SPARK[min(int(v / top * 7.999), 7)] if v > 0 else " " for v in values).rjust(width)


ALL_STATES = [s.value for s in State]
