"""The shard's total tokens, read in the background while the GPU works.

Samples are length-sorted (longest first within each read window), so samples/s swings by 10x
over a shard while tokens/s stays flat: an ETA or a comparison with the expected rate is honest
only in tokens, and that needs the shard's total tokens. This reads the shard's rows once more
through the same rules as the extraction (`iter_shard`: malformed, too long and unsupervised rows
left out, `--max-length` truncation applied), one row at a time, in a daemon thread, and hands the
sum to the event log, which puts it on every later progress event (`total_tokens`), with the
rows and the sum of each row's tokens squared (`total_rows`, `total_sq_tokens`) and the FLOP
model's weight of attention (`attention_weight`): what fleet's ETA weighs the work left by, since
a long row costs more per token than a short one (its attention grows with its length).

On a CPU the FLOP model is not what the host does (attention there is memory-bound: the demo's
long rows cost 1.3-2.6x what it says per token of attention), so `measured_weight` times the
model at load, one long row against the same tokens in short rows, and that weight goes out
instead. On a GPU it is not timed: a forward at shapes the shard never runs would compile or tune
kernels for them; the FLOP model stands there and the supervisor's fit corrects it.

Raw chats are tokenized by a tokenizer of the thread's own (a fast tokenizer is not safe to share
between threads); any error just leaves the total unknown — the extraction reports its own.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import threading
from typing import Callable

from .data import BadRow
from .events import EventLog
from .rows import Later, iter_shard


def shard_work(dataset, start: int, stop: int, vocab_size: int, tokenizer, options) -> tuple[int, int, int]:
    """(rows, tokens, sum of tokens squared) of every row of [start, stop) that the extraction will
    write (done or not)."""
    one_by_one = dataclasses.replace(options, sort_window=1)
    rows = tokens = sq = 0
    for item in iter_shard(dataset, start, stop, set(), vocab_size, tokenizer, one_by_one):
        if not isinstance(item, BadRow):
            assert not isinstance(item, Later), "no rows are held back: `later` is empty"
            for s in item:
                rows, tokens, sq = rows + 1, tokens + s.length, sq + s.length * s.length
    return rows, tokens, sq


def shard_tokens(dataset, start: int, stop: int, vocab_size: int, tokenizer, options) -> int:
    """Tokens of every row of [start, stop) that the extraction will write (done or not)."""
    return shard_work(dataset, start, stop, vocab_size, tokenizer, options)[1]


def attention_weight(config) -> float | None:
    """What one position of attention costs against the rest of a token's work, in FLOPs: a row
    of L tokens costs L x (2 x the decoder's weights a token meets) + L^2 x (4 x heads x head_dim
    per full-attention layer: QK^T and AV, computed whole). A prior only: the supervisor fits the
    real costs once the rows it has seen differ enough in length. None where the config lacks
    the shape."""
    try:
        hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        inter = getattr(config, "intermediate_size", None) or 4 * hidden
        if getattr(config, "num_experts_per_tok", None) and getattr(config, "moe_intermediate_size", None):
            inter = config.num_experts_per_tok * config.moe_intermediate_size + \
                (getattr(config, "shared_expert_intermediate_size", None) or 0)
        types = getattr(config, "layer_types", None)
        full = sum(1 for t in types if t == "full_attention") if types else layers
        linear = 2 * layers * (hidden * head_dim * (heads + 2 * kv) + heads * head_dim * hidden + 3 * hidden * inter)
        return round(4 * heads * head_dim * full / linear, 9) if linear > 0 else None
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


LONG_ROW, SHORT_ROW = 512, 32      # the lengths `measured_weight` times (the demo's rows: 8 to ~1,000)


def measured_weight(forward: Callable[[int, int], float], prior: float | None,
                    long: int = LONG_ROW, short: int = SHORT_ROW, repeats: int = 3) -> float | None:
    """Attention's weight as this host runs the model: `forward(rows, width)` (its seconds) on one
    row of `long` tokens and on long/short rows of `short`, the same tokens, timed back to back
    `repeats` times. A row of L tokens costs c x L x (1 + w x L), so each pair of times gives w;
    the median pair's is kept (another process's burst spoils a pair, not the figure). None when
    the times say nothing (the long row no dearer) or fall outside [prior / 4, prior x 8]."""
    if long < 4 * short:
        return None                                              # too short a model to tell them apart
    forward(1, short)                                            # first-call costs, untimed
    weights = []
    for _ in range(repeats):
        a, b = forward(1, long), forward(long // short, short)
        denominator = b * long - a * short
        weights.append((a - b) / denominator if a > b and denominator > 0 else 0.0)
    weight = statistics.median(weights)
    if weight <= 0 or prior is not None and not prior / 4 <= weight <= prior * 8:
        return None
    return round(weight, 9)


class Sizer:
    """Sizes one worker's rows in daemon threads; the log stamps the result on later progress
    events. `weight`: attention's weight as measured on this host (else the FLOP model's, from
    `config`). `start` is called again whenever the shard's ranges change (a new lease, a steal
    that cut this one): each range is read once, and a sizing overtaken by a newer one publishes
    nothing."""

    def __init__(self, log: EventLog, dataset, vocab_size: int, model: str, options, config=None,
                 weight: float | None = None):
        self.log, self.dataset, self.vocab_size, self.options = log, dataset, vocab_size, options
        if weight is None and config is not None:
            weight = attention_weight(config)
        if weight is not None:
            log.work = {**log.work, "attention_weight": weight}   # replaced whole: emit() reads it unlocked
        self._sized: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._generation = 0
        self._lock = threading.Lock()
        self._reading = threading.Lock()        # one sizing reads at a time: the tokenizer is the threads'

        @functools.cache
        def tokenizer():
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(model)
        self._tokenizer = tokenizer

    def _work(self, a: int, b: int) -> tuple[int, int, int]:
        """shard_work of [a, b), each row read once: a lease a steal cut short is the longer one
        sized before less the rows cut off (every row counts on its own)."""
        if (a, b) not in self._sized:
            longer = min((y for x, y in self._sized if x == a and y > b), default=None)
            if longer is None:
                self._sized[a, b] = self._read(a, b)
            else:
                (rows, tokens, sq), (cut_rows, cut_tokens, cut_sq) = self._sized[a, longer], self._read(b, longer)
                self._sized[a, b] = (rows - cut_rows, tokens - cut_tokens, sq - cut_sq)
        return self._sized[a, b]

    def _read(self, a: int, b: int) -> tuple[int, int, int]:
        return shard_work(self.dataset, a, b, self.vocab_size, self._tokenizer, self.options)

    def start(self, ranges: list[tuple[int, int]]) -> threading.Thread:
        """Size `ranges` (the shard's finished leases and the one it holds) in the background."""
        with self._lock:
            self._generation += 1
            generation = self._generation

        def run() -> None:
            try:
                with self._reading:
                    parts = [self._work(a, b) for a, b in ranges]
                rows, tokens, sq = (sum(p[i] for p in parts) for i in range(3))
            except Exception:
                return                                  # unknown: throughput stays in samples
            with self._lock:
                if generation != self._generation:
                    return
                self.log.work = {**self.log.work, "total_rows": rows, "total_sq_tokens": sq}
                self.log.total_tokens = tokens

        thread = threading.Thread(target=run, name="sizing", daemon=True)
        thread.start()
        return thread
