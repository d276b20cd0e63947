"""Free disk at a path that may not exist yet (the output folder before the first file): the one
probe that preflight and the agent share. Standard library only."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class DiskSpace:
    path: str          # the folder asked about
    probe: str         # the nearest existing folder, which statvfs measured
    free: int          # bytes available to this user
    total: int


def disk_space(path: str) -> DiskSpace:
    """statvfs of `path` or its nearest existing parent; OSError when even that fails."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return DiskSpace(path, probe, st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize)
