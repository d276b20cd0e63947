"""The supervisor's word when it falls behind its hosts (stopped, starved, a backlog of lines) and
when it has caught up: once each, since meanwhile nothing is restarted or failed on their word
(`Host.catching_up` holds their shards' actions). Apart so the decide pass only asks it to look.
"""

from __future__ import annotations

from typing import Callable

from .hosts import Host


class CatchingUp:
    """Which hosts we were catching up with, as last told."""

    def __init__(self, say: Callable[[str], None]):
        self.say = say
        self.behind: set[str] = set()

    def look(self, hosts: dict[str, Host]) -> None:
        """Say so if the hosts we are behind went from none to some, or from some to none."""
        behind = {n: h for n, h in hosts.items() if h.reachable and h.catching_up}
        if behind and not self.behind:
            worst = max((h.behind_s for h in behind.values()), default=0.0)
            self.say(f"catching up: {worst:.0f} s behind {', '.join(sorted(behind))}" if worst else
                     f"catching up with {', '.join(sorted(behind))}: this process ran late; nothing is "
                     f"restarted or failed until their records are read up to now")
        elif self.behind and not behind:
            self.say("caught up")
        self.behind = set(behind)
