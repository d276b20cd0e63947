"""Bugs a test can switch on in the worker's real path (FLEET_INJECT_BUG=name[,name]), so the
content checks (worker/stats.py, worker/reference.py) are shown to catch each class of silent wrong
output that the peers shipped: a layer zeroed after the compiled region, two rows of a batch
swapped, padding leaking into a short row, fp8 scales dropped; and a chat's loss mask moved onto
the turn before each assistant turn (a template change that shifts the mask). Never set outside
tests; a name that is not one of these is refused, so a typo cannot make a test pass vacuously.
"""

from __future__ import annotations

import os

BUGS = ("zero-layer", "swap-rows", "pad-leak", "fp8-no-scales", "mask-early")
_ON = frozenset(filter(None, os.environ.get("FLEET_INJECT_BUG", "").split(",")))
if _ON - set(BUGS):
    raise SystemExit(f"FLEET_INJECT_BUG: unknown bug {sorted(_ON - set(BUGS))[0]!r} (one of {', '.join(BUGS)})")


def bug(name: str) -> bool:
    return name in _ON


def mask_early(mask):
    """Each supervised run moved back by its own length (onto what comes before it: the prompt)."""
    out = mask.copy()
    out[:] = 0
    t, n = 0, len(mask)
    while t < n:
        if mask[t]:
            end = t
            while end < n and mask[end]:
                end += 1
            out[max(0, 2 * t - end):t] = 1
            t = end
        else:
            t += 1
    return out
