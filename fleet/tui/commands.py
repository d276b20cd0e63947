"""`:` command mode (k9s): a line typed at the bottom of the main screen, parsed into a typed
command the screen carries out (restarts and stops still ask first).

    :restart 17          :restart 3,5-7       :restart failed     restart shards (asks)
    :stop 17             stop shards (asks)
    :log 17              open a shard's log
    :host box05          only that host's shards (:host alone clears)
    :state failed        only shards in these states (comma separated; :state alone clears)
    :sort eta            sort by a column (:sort -eta reverses)
    :filter REGEX        the same as /
    :clear               every filter off
    :help  :quit
"""

from __future__ import annotations

from dataclasses import dataclass

from ..state import RESTARTABLE, State

COMMANDS = ("restart", "stop", "log", "host", "state", "sort", "filter", "clear", "help", "quit")
ALIASES = {"q": "quit", "r": "restart", "k": "stop", "l": "log", "s": "sort", "f": "filter",
           "h": "help", "?": "help", "q!": "quit"}


class CommandError(ValueError):
    """What was typed cannot be carried out; the message says why (and what would be)."""


@dataclass(frozen=True)
class Command:
    name: str
    shards: tuple[int, ...] = ()
    arg: str = ""
    reverse: bool = False


def parse_ids(text: str, known: set[int], states: dict[int, str]) -> tuple[int, ...]:
    """'17', '3,5-7', 'failed' (every FAILED, BACKOFF and FATAL shard), 'all' -> shard ids."""
    text = text.strip().lower()
    if text in ("failed", "faulty"):
        return tuple(sorted(k for k, s in states.items() if State(s) in RESTARTABLE))
    if text == "all":
        return tuple(sorted(known))
    out: list[int] = []
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise CommandError(f"not a shard id or range: {part!r}")
        ids = range(int(lo), int(hi) + 1) if sep else [int(lo)]
        for k in ids:
            if k not in known:
                raise CommandError(f"no shard {k}")
            out.append(k)
    if not out:
        raise CommandError("which shard? e.g. :restart 17 or :restart 3,5-7 or :restart failed")
    return tuple(dict.fromkeys(out))


def parse(line: str, known: set[int], states: dict[int, str], hosts: set[str],
          columns: list[str]) -> Command:
    words = line.strip().lstrip(":").split(maxsplit=1)
    if not words:
        raise CommandError("empty command; " + "try " + ", ".join(f":{c}" for c in COMMANDS))
    name = ALIASES.get(words[0].lower(), words[0].lower())
    arg = words[1].strip() if len(words) > 1 else ""
    if name not in COMMANDS:
        raise CommandError(f"unknown command {words[0]!r}; known: " + " ".join(f":{c}" for c in COMMANDS))
    if name in ("restart", "stop"):
        return Command(name, parse_ids(arg, known, states))
    if name == "log":
        ids = parse_ids(arg, known, states)
        if len(ids) != 1:
            raise CommandError(":log takes one shard")
        return Command(name, ids)
    if name == "host":
        if arg and arg not in hosts:
            raise CommandError(f"no host {arg!r}; hosts: {', '.join(sorted(hosts))}")
        return Command(name, arg=arg)
    if name == "state":
        wanted = [w.strip().upper() for w in arg.replace(" ", ",").split(",") if w.strip()]
        bad = [w for w in wanted if w not in State.__members__]
        if bad:
            raise CommandError(f"no state {bad[0]!r}; states: {' '.join(s.value for s in State)}")
        return Command(name, arg=",".join(wanted))
    if name == "sort":
        reverse = arg.startswith("-")
        column = arg.lstrip("-+").lower()
        if column not in columns:
            raise CommandError(f"no column {column!r}; columns: {' '.join(columns)}")
        return Command(name, arg=column, reverse=reverse)
    return Command(name, arg=arg)
