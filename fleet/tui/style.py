"""Colours and text bars shared by the panes."""

from __future__ import annotations

STATE_STYLE = {
    "PENDING": "dim", "DEPLOYING": "cyan", "STARTING": "cyan", "LOADING": "cyan",
    "RUNNING": "green", "DONE": "bold green", "STALLED": "yellow", "FAILED": "bold red",
    "BACKOFF": "yellow", "FATAL": "bold white on red", "STOPPED": "dim", "UNKNOWN": "magenta",
}
ALERT_STYLE = {None: "green", "ok": "green", "low": "yellow", "critical": "red"}


def bar(fraction: float, width: int) -> str:
    """A text bar of `width` cells, eighths for the partial cell."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = int(round(fraction * width * 8))
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part else ""
    return ("█" * full + partial).ljust(width, "·")[:width]
