"""Length-sorted batches under a token budget (pure; the GPU loop consumes them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def row_bucket(rows: int) -> int:
    """The largest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and 1.5x them) not above
    `rows`: batches keep at least two thirds of the budget, and kernels that tune per row count
    (flash-linear-attention's) see a few dozen row counts in a whole shard, not hundreds."""
    bucket = 1
    while bucket * 2 <= rows:
        bucket *= 2
    return bucket * 3 // 2 if bucket >= 2 and bucket * 3 // 2 <= rows else bucket


def make_batches(samples: Sequence, max_tokens: int, pad_multiple: int = 1,
                 bucket_rows: bool = False) -> list[list]:
    """Longest first (an OOM shows itself at the start), each batch's rows x padded length within
    `max_tokens`; a sample longer than the budget gets a batch of its own. `bucket_rows`: each
    batch's row count is a `row_bucket` (few distinct batch shapes)."""
    batches: list[list] = []
    ordered = sorted(samples, key=lambda s: (-s.length, s.index))
    i = 0
    while i < len(ordered):
        width = padded_length(ordered[i].length, pad_multiple)
        rows = max(1, max_tokens // width)
        if bucket_rows:
            rows = row_bucket(rows)
        batches.append(ordered[i:i + rows])
        i += rows
    return batches


@dataclass(frozen=True, slots=True)
class Row:
    """A row known only by its length (row i of a list of lengths has index i). (Not a NamedTuple:
    its `index` would hide tuple.index.)"""
    index: int
    length: int


def length_batches(lengths: Sequence[int], max_tokens: int, pad_multiple: int = 1,
                   bucket_rows: bool = False) -> list[list[Row]]:
    """`make_batches` over bare lengths: the batches a shard makes of rows this long."""
    return make_batches([Row(i, n) for i, n in enumerate(lengths)], max_tokens, pad_multiple, bucket_rows)


def padding_share(batches: Sequence[Sequence], pad_multiple: int) -> float:
    """The share of the batches' tokens that are padding (computed and thrown away)."""
    padded = sum(len(b) * padded_length(max(s.length for s in b), pad_multiple) for b in batches)
    return 1 - sum(s.length for b in batches for s in b) / padded if padded else 0.0
