"""A shard's rows as the extraction reads them: the options that decide which rows are written
and how (`Options`), and `iter_shard`, which turns [start, stop) into chunks of valid samples,
a BadRow for each row that will not be extracted, and the held-back suspects (`Later`) — read by
the extraction (worker/extract.py) and by the sizing of its work (worker/sizing.py), so both
apply the same rules."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Callable, Iterator

from . import inject
from .data import BadRow, Sample, row_to_sample
from .formats import supervision_problem
from .leases import Cell


@dataclass
class Options:
    max_tokens_per_batch: int = 16384
    max_length: int | None = None
    too_long: str = "skip"
    writer_queue: int = 3
    writer_threads: int = 4
    sort_window: int = 20000
    pad_multiple: int = 8
    loss_mask: str = "assistant"
    format: str = "speculators"
    max_positions: int | None = None     # the model's longest sequence; longer rows are skipped
    bucket_rows: bool = False            # batch row counts from a few buckets (batching.row_bucket)
    dtype: str = "bf16"                  # hidden states as stored: bf16 | fp8
    micro_batches: int | None = None     # row groups per batch (None: one per GPU of the shard)
    window: int | None = None            # the trainer's window (from:<run.yaml> data.max_length)
    spill: tuple[str, ...] = ()          # other disks' folders the samples' bytes go to in turn


@dataclass
class Later:
    """Samples that run after the rest, each alone (the suspects of an earlier crash)."""
    samples: list[Sample]


def iter_shard(dataset, start: int, stop: int, finished: set[int], vocab_size: int,
               tokenizer: Callable, options: Options, later: AbstractSet[int] = frozenset(),
               cell: Cell | None = None) -> Iterator[list[Sample] | BadRow | Later]:
    """Unfinished rows of [start, stop): valid samples in chunks of at most `sort_window`, and a
    BadRow for each row that will not be extracted (malformed, too long); the valid samples of
    `later` come last, held back as one Later. With a lease's `cell`, a row is read only once the
    cell admits it (a steal may have moved the lease's end), in chunks of the cell's window, so
    that a steal finds rows not yet read."""
    chunk: list[Sample] = []
    held: list[Sample] = []
    window = options.sort_window
    for index, row in dataset.rows(start, stop):
        if cell is not None:
            if not chunk:
                window = cell.window(index, options.sort_window)
            if not cell.admit(index):
                break
        if index in finished:
            continue
        sample = row_to_sample(index, row, vocab_size, tokenizer, options.loss_mask)
        if isinstance(sample, BadRow):
            yield sample
            continue
        if options.max_length and sample.length > options.max_length:
            if options.too_long == "skip":
                yield BadRow(index, f"too long: {sample.length} tokens > --max-length {options.max_length}")
                continue
            sample = Sample(index, sample.input_ids[: options.max_length],
                            sample.loss_mask[: options.max_length], sample.chat)
        if options.max_positions and sample.length > options.max_positions:
            yield BadRow(index, f"longer than the model's {options.max_positions} positions: "
                                f"{sample.length} tokens")
            continue
        if problem := supervision_problem(options.format, sample.loss_mask, options.max_length or options.window):
            yield BadRow(index, problem)
            continue
        if inject.bug("mask-early") and sample.chat is not None:
            sample.loss_mask = inject.mask_early(sample.loss_mask)
        if index in later:
            held.append(sample)
            continue
        chunk.append(sample)
        if len(chunk) >= window:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
    if held:
        yield Later(held)
