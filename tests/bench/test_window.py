"""bench/window.py: the rows it gives a bench are cut by the worker into exactly the batches it
chose from the real window (so the bench pads as a shard does), and they are about as many as asked."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from bench.window import window_lengths
from worker.batching import length_batches, padding_share
from worker.demo import sharegpt_lengths


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), window=st.integers(1, 3000), share=st.floats(0.01, 1.0),
       budget=st.sampled_from([512, 2048, 16384]), pad=st.sampled_from([1, 8, 16, 64]),
       max_len=st.sampled_from([600, 8192]))
def test_the_chosen_rows_are_batched_again_into_the_batches_chosen(seed, window, share, budget, pad, max_len):
    samples = max(1, int(window * share))
    chosen = window_lengths(seed, samples, budget, pad, window=window, max_len=max_len)
    # The window as a shard would cut it, computed here from the same draw, and every k-th batch.
    import random
    lengths = [min(n, max_len) for n in sharegpt_lengths(random.Random(seed), window, 728)]
    every = max(1, round(window / samples))
    picked = length_batches(lengths, budget, pad)[every // 2::every]
    again = length_batches(chosen, budget, pad)
    assert [[r.length for r in b] for b in again] == [[r.length for r in b] for b in picked]
    assert padding_share(again, pad) == padding_share(picked, pad)
    assert sum(len(b) for b in picked) == len(chosen)


def test_a_real_window_pads_less_than_a_small_bench_of_the_same_rows():
    """What the module is for: 20,000 rows sorted together pad under half of what 1,300 do."""
    small = sharegpt_lengths(__import__("random").Random(2), 1300, 728)
    sampled = window_lengths(2, 1300, 16384, 16)
    assert 1000 <= len(sampled) <= 1700
    small_pad = padding_share(length_batches([min(n, 8192) for n in small], 16384, 16), 16)
    window_pad = padding_share(length_batches(sampled, 16384, 16), 16)
    assert window_pad < small_pad / 2
