"""Index ranges, one definition for both sides: the rows of a shard, and runs of indices.

Standard library only (it travels to every host and `fleet` imports it; fleet never imports numpy
or torch). A shard owns a contiguous range of global indices; a set of indices is told as
half-open runs `[[start, stop), ...]` on the wire (verify's reports); their text "0-2,5,7-8" (to a
person, or to Slurm's `--array`) is worker/text.py's, with every other value's.
"""

from __future__ import annotations

from typing import Iterable, Iterator


def shard_range(num_rows: int, num_shards: int, shard: int) -> tuple[int, int]:
    """Contiguous [start, stop) of shard `shard`: every index in exactly one shard, sizes within 1."""
    if num_shards < 1 or not 0 <= shard < num_shards:
        raise ValueError(f"shard index {shard} out of range for {num_shards} shard(s)")
    return shard * num_rows // num_shards, (shard + 1) * num_rows // num_shards


def shard_of(index: int, num_rows: int, num_shards: int) -> int:
    """The shard whose range holds `index` (the inverse of shard_range, for 0 <= index < num_rows)."""
    return next(k for k in range(num_shards - 1, -1, -1) if k * num_rows // num_shards <= index)


def to_runs(indices: Iterable[int]) -> list[list[int]]:
    """Indices (any order, repeats allowed) -> sorted, disjoint, non-touching [[start, stop), ...]."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return runs


def expand(runs: Iterable[Iterable[int]]) -> Iterator[int]:
    """[[start, stop), ...] -> every index in them, in order."""
    for a, b in runs:
        yield from range(a, b)
