"""Bench rows that batch and pad as a real shard's rows do.

A shard reads its rows a sort window at a time (the worker's `--sort-window`, 20,000 rows) and
cuts each window into batches longest first, so a batch's rows differ by a few tokens. A bench
of 1,300 rows sorts only those: its neighbours lie ~15x further apart in length, and its batches
pad several times more of their tokens than a real window's (ShareGPT-like lengths, widths to 16:
4.8% at 1,000 rows, 1.3% in a window of 20,000). `window_lengths` gives the rows of every k-th
batch of one real window instead: the very batches a shard runs, a systematic sample of them,
which the worker cuts again into the same batches (tests/bench/test_window.py holds it to that).
"""

from __future__ import annotations

import random

from worker.batching import length_batches
from worker.demo import sharegpt_lengths

WINDOW = 20000      # worker/extract.py's --sort-window default


def window_lengths(seed: int, samples: int, budget: int, pad: int, window: int = WINDOW,
                   mean: float = 728, max_len: int = 8192) -> list[int]:
    """About `samples` row lengths: the rows of every k-th batch (k = window / samples) that a
    shard cuts from one sort window of `window` ShareGPT-like rows, in the window's own order."""
    rng = random.Random(seed)
    lengths = [min(n, max_len) for n in sharegpt_lengths(rng, window, mean)]
    batches = length_batches(lengths, budget, pad)
    every = max(1, round(window / max(samples, 1)))
    chosen = sorted(row.index for batch in batches[every // 2::every] for row in batch)
    return [lengths[i] for i in chosen]
