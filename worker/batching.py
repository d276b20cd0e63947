"""Length-sorted batches under a token budget (pure; the GPU loop consumes them)."""

from __future__ import annotations

from typing import Sequence


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def make_batches(samples: Sequence, max_tokens: int, pad_multiple: int = 1) -> list[list]:
    """Longest first (an OOM shows itself at the start), each batch's rows x padded length within
    `max_tokens`; a sample longer than the budget gets a batch of its own."""
    batches: list[list] = []
    current: list = []
    width = 0
    for s in sorted(samples, key=lambda s: (-s.length, s.index)):
        if not current:
            width = padded_length(s.length, pad_multiple)
        elif (len(current) + 1) * width > max_tokens:
            batches.append(current)
            current, width = [], padded_length(s.length, pad_multiple)
        current.append(s)
    if current:
        batches.append(current)
    return batches
