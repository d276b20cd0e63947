"""The shard's total tokens, read in the background while the GPU works.

Samples are length-sorted (longest first within each read window), so samples/s swings by 10x
over a shard while tokens/s stays flat: an ETA or a comparison with the expected rate is honest
only in tokens, and that needs the shard's total tokens. This reads the shard's rows once more
through the same rules as the extraction (`iter_shard`: malformed, too long and unsupervised rows
left out, `--max-length` truncation applied), one row at a time, in a daemon thread, and hands the
sum to the event log, which puts it on every later progress event (`total_tokens`).

Raw chats are tokenized by a tokenizer of the thread's own (a fast tokenizer is not safe to share
between threads); any error just leaves the total unknown — the extraction reports its own.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

from .data import BadRow
from .events import EventLog


def shard_tokens(dataset, start: int, stop: int, vocab_size: int, tokenizer, options) -> int:
    """Tokens of every row of [start, stop) that the extraction will write (done or not)."""
    from .extract import iter_shard                     # extract imports this module
    one_by_one = dataclasses.replace(options, sort_window=1)
    total = 0
    for item in iter_shard(dataset, start, stop, set(), vocab_size, tokenizer, one_by_one):
        if not isinstance(item, BadRow):
            total += sum(s.length for s in item)
    return total


def start(log: EventLog, dataset, start: int, stop: int, vocab_size: int, model: str,
          options) -> threading.Thread:
    """Size the shard in a daemon thread; the log stamps the result on later progress events."""

    @functools.cache
    def tokenizer():
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(model)

    def run() -> None:
        try:
            log.total_tokens = shard_tokens(dataset, start, stop, vocab_size, tokenizer, options)
        except Exception:
            pass                                        # unknown: throughput stays in samples

    thread = threading.Thread(target=run, name="sizing", daemon=True)
    thread.start()
    return thread
