"""Bugs a test can switch on in the worker's real path (FLEET_INJECT_BUG=name[,name]), so the
content checks (worker/stats.py, worker/reference.py) are shown to catch each class of silent wrong
output that the peers shipped: a layer zeroed after the compiled region, two rows of a batch
swapped, padding leaking into a short row, fp8 scales dropped. Never set outside tests; a name
that is not one of these is refused, so a typo cannot make a test pass vacuously.
"""

from __future__ import annotations

import os

BUGS = ("zero-layer", "swap-rows", "pad-leak", "fp8-no-scales")
_ON = frozenset(filter(None, os.environ.get("FLEET_INJECT_BUG", "").split(",")))
if _ON - set(BUGS):
    raise SystemExit(f"FLEET_INJECT_BUG: unknown bug {sorted(_ON - set(BUGS))[0]!r} (one of {', '.join(BUGS)})")


def bug(name: str) -> bool:
    return name in _ON
