"""`python -m worker.extract`: run one shard of a dataset through a causal LM and save hidden states.

Resumable (a restart skips everything in the output's manifests, whatever the shard count), atomic
(a kill at any moment leaves no file that `hs_*.safetensors` matches half-written), and fast:
length-sorted batches under a token budget, no attention mask (right padding under a causal mask
never reaches a real token, and repeats a token of the row), hooks on exactly the requested
layers, copies to the host on a side stream, a bounded background writer.

This module runs a shard from start to end; each step lives with what it does: the command line
(worker.extract_args), what is settled before the load (worker.shard_setup), the model made ready
(worker.warmup), the GPU loop (worker.extractor), the rows that count and their counts
(worker.shard_rows), meta.json (worker.output_meta), shipping (worker.shard_shipping), and how a
shard ends (worker.shard_exit).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, cast

import torch

from . import files, protocol, sizing
from .data import Dataset
from .events import EventLog
from .extract_args import make_options, parse_args
from .extractor import gpu_memory, host_peak_bytes, run_extraction
from .formats import Layout
from .identity import ModelShape
from .layers import LayerPlan
from .leases import Lease, Pool
from .model import compute_dtype, is_hybrid, load_model, missing_fast_kernels, model_devices, text_config
from .output_meta import write_run_meta
from .reference import CheckFailed, ReferenceChecks
from .rows import Options, iter_shard
from .shard_exit import ForeignOutput, NotRetryable, failure_exit, on_term
from .shard_rows import Holding, pool_ranges, resumed_stats, retry_on_a_persons_launch, tell_source, too_many_skipped
from .shard_setup import (chat_tokenizer, check_gpus_visible, check_identity, claim_folders, open_shard,
                          resolve_work, shard_devices)
from .shard_shipping import ship_pool_leftovers, start_shipping
from .ship import Shipper
from .suspects import Suspects, suspects_path
from .text import bytes_text
from .warmup import HYBRID_PAD, choose_path, host_weight, start_tuner, use_cache_dir
from .warmup import row_buckets, warm_rows  # noqa: F401  (bench/extract.py imports them from here)
from .writer import Stats, load_finished

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Shard:
    """What a shard settled before its model loads: its command line and record, the devices its
    layers spread over, the dtype it computes in, its dataset and planned rows [start, stop), the
    model's shape, the layers it captures and the files' layout."""
    args: argparse.Namespace
    log: EventLog
    device: torch.device
    devices: list[str]
    dtype: torch.dtype
    dtype_note: str
    dataset: Dataset
    start: int
    stop: int
    shape: ModelShape
    plan: LayerPlan
    layout: Layout


@dataclass
class ReadyModel:
    """The model loaded and made ready, and what the rest of the shard reads from it once."""
    model: torch.nn.Module
    gpus: list[torch.device]      # the devices it runs on (the memory figures are summed over them)
    vocab_size: int               # an id at or past it makes a bad row
    config: Any                   # its text config
    pad: int                      # batch widths are a multiple of it
    path: str                     # how it runs: compiled, or eager and why (the `loaded` event's)
    weight: float | None          # attention's weight for the ETA, as timed on a CPU


@dataclass
class Extraction:
    """What every lease's extraction runs with."""
    ready: ReadyModel
    options: Options
    tokenizer: Callable[[], Any]
    sizer: sizing.Sizer
    shipper: Shipper | None
    checks: ReferenceChecks | None


@dataclass
class ShardCounts:
    """What counts for the shard now: its counters, over the row ranges that count for it."""
    log: EventLog
    stats: Stats
    counted: list[tuple[int, int]]

    def total(self) -> int:
        return sum(b - a for a, b in self.counted)

    def beat(self) -> None:
        """A progress tick while the shard waits (for a lease, for its files to land)."""
        self.log.emit(protocol.Progress(**self.stats.snapshot(), total=self.total()))


def main(argv: list[str] | None = None) -> int:
    """Run the shard: open it, claim its output, load the model, extract what is left of its
    rows; an error ends it with a failure event and an exit code that says what kind it was."""
    args = parse_args(argv)
    os.umask(os.umask(0o022) | 0o022)          # output and state never world- or group-writable
    log = EventLog(args.state, args.shard_index)
    signal.signal(signal.SIGTERM, on_term)
    use_cache_dir(args.cache_dir)
    devices = shard_devices(args)
    device = torch.device(devices[0])
    try:
        return run_shard(args, log, device, devices)
    except (Exception, KeyboardInterrupt) as e:
        if isinstance(e, (NotRetryable, CheckFailed)) and not isinstance(e, ForeignOutput):  # verify reads it
            files.note_fatal(args.out, args.shard_index, str(e))
        return failure_exit(log, e)


def run_shard(args: argparse.Namespace, log: EventLog, device: torch.device, devices: list[str]) -> int:
    """The shard from its first event to `done`: checked and claimed before the model loads (and
    done at once when its pool has no rows left for it), then lease after lease extracted."""
    shard = settle(args, log, device, devices)
    identity = check_identity(args, shard.plan)        # before any file is touched
    # `lock` is held for the process's life: one writer per output folder, one process per shard
    lock = claim_folders(args)
    shipper = start_shipping(args, log, shard.layout)
    pool = Pool(args.out, args.shard_index, pool_ranges(args, shard.dataset.num_rows), shard.dataset.num_rows)
    retry_on_a_persons_launch(args, log)
    finished = load_finished(args.out)
    pool.reopen(lambda a, b: any(i not in finished for i in range(a, b)))   # rows a repair dropped
    lease = pool.own()
    if lease is None and pool.empty():           # its rows were done by the others: no model load
        return pool_done(args, log, pool, shipper, shard.layout)
    ready = load(shard, lease or Lease(shard.start, shard.stop, 0, shard.start), set(finished))
    write_run_meta(args, ready.config, shard.dtype, shard.layout, shard.dataset.num_rows, identity)
    options = make_options(args, shard.shape, ready.pad, ready.config)
    tokenizer = chat_tokenizer(args.model)
    counted = pool.counted()
    sizer = sizing.Sizer(log, shard.dataset, ready.vocab_size, args.model, options, ready.config, ready.weight)
    counts = ShardCounts(log, resumed_stats(load_finished(args.out), counted), counted)
    work = Extraction(ready, options, tokenizer, sizer, shipper, reference_checks(shard, ready, tokenizer))
    lost = extract_leases(shard, pool, lease, counts, work)
    pool.close()
    if lost:                                   # what counts for it is what the ledger says now
        counts.stats = resumed_stats(load_finished(args.out), counts.counted)
    finish(shard, counts, shipper, ready.gpus)
    lock.close()
    return 0


def settle(args: argparse.Namespace, log: EventLog, device: torch.device, devices: list[str]) -> Shard:
    """The device chosen, the compute dtype, the dataset opened (the `started` event) and the work
    resolved: the model's shape, the layers and the layout."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype, dtype_note = compute_dtype(args.model_dtype, device)
    dataset, start, stop = open_shard(args, log, device)
    shape, plan, layout = resolve_work(args)
    return Shard(args, log, device, devices, dtype, dtype_note, dataset, start, stop, shape, plan, layout)


def load(shard: Shard, first: Lease, finished: set[int]) -> ReadyModel:
    """The model loaded (a hybrid's kernels tuned meanwhile for the rows of its `first` lease),
    compiled or eager, timed on a CPU, and told in the `loaded` event."""
    args, log, device = shard.args, shard.log, shard.device
    log.emit(protocol.Loading(model=args.model))
    t0 = time.perf_counter()
    check_gpus_visible(device, shard.devices)
    tuner = start_tuner(args, shard.dataset, first.start, first.stop, finished, device, shard.dtype, shard.shape,
                        log)

    def reading(done: int, total: int, rate: float) -> None:
        log.emit(protocol.Loading(model=args.model, detail=f"reading the weights: {bytes_text(done)} of "
                                                           f"{bytes_text(total)} ({bytes_text(rate)}/s)"))

    model = load_model(args.model, shard.devices, shard.dtype, args.random_weights,
                       interval=args.progress_interval, on_read=reading)
    gpus = model_devices(model, device)
    embeddings = cast("PreTrainedModel", model).get_input_embeddings()
    vocab_size = cast(torch.nn.Embedding, embeddings).num_embeddings
    config = text_config(model)
    pad = args.pad_multiple or (1 if device.type != "cuda" else HYBRID_PAD if is_hybrid(model) else 8)
    path = "; ".join(filter(None, (choose_path(model, device, args, log, max(8, pad), tuner), shard.dtype_note)))
    weight, cpu_rate = host_weight(model, device, args, log, config, shard.shape.max_positions)
    log.emit(protocol.Loaded(seconds=round(time.perf_counter() - t0, 2), **gpu_memory(gpus),
                             layer_ids=list(shard.plan.ids), last_layer_norm=shard.plan.last_layer_norm,
                             path=path, cpu_tokens_per_s=cpu_rate))
    if warning := missing_fast_kernels(model):
        log.emit(protocol.WarningEvent(message=warning))
    return ReadyModel(model, gpus, vocab_size, config, pad, path, weight)


def reference_checks(shard: Shard, ready: ReadyModel, tokenizer: Callable[[], Any]) -> ReferenceChecks | None:
    """The shard's reference checks (worker/reference.py), unless --reference-checks 0."""
    args = shard.args
    if args.reference_checks <= 0:
        return None
    return ReferenceChecks(ready.model, shard.layout, args.out, args.shard_index, args.reference_checks,
                           shard.stop - shard.start, shard.log.emit, ready.path, tokenizer, args.loss_mask)


def extract_leases(shard: Shard, pool: Pool, lease: Lease | None, counts: ShardCounts, work: Extraction) -> bool:
    """Extract the lease it holds, then each next one its pool gives it (a dead mate's, or half a
    live one's) until none is left. True when rows it held moved away (its host was lost): those
    it stopped, and what counts for it is then the pool's word."""
    args, log = shard.args, shard.log
    how, source, origin = "plan", None, None
    lost = False
    while True:
        if lease is None:
            got = pool.next(beat=counts.beat)
            if got is None:                    # no member holds rows any more
                return lost
            lease, move = got
            how, source, origin = move.how, (move.source if move.source >= 0 else None), move.origin
            if move.how == "dead":
                tell_source(args, move, pool.counted_for(move.source))
        held = Holding(args.out, lease, pool.counted(), log, work.sizer.start, tuple(args.spill))
        log.emit(protocol.Leased(start=lease.start, stop=lease.stop, rows=held.owed, epoch=lease.epoch,
                                 how=how, from_shard=source, from_host=origin))
        if extract_lease(shard, pool, lease, held, work):    # moved away (its host was lost): stopped, go on
            lost = True
        counts.stats = held.stats
        pool.finish()
        counts.counted, lease = pool.counted() if lost else held.ranges, None


def extract_lease(shard: Shard, pool: Pool, lease: Lease, held: Holding, work: Extraction) -> bool:
    """One lease's rows through the GPU loop, the rows of an earlier crash's suspects last; True
    when some of them moved away meanwhile (their host was lost) and were stopped."""
    args, log, ready = shard.args, shard.log, work.ready
    suspects = Suspects(suspects_path(args.out, args.shard_index), set(held.finished), lease.start, lease.stop)
    done = set(held.finished) | ({suspects.culprit} if suspects.culprit is not None else set())
    cell = pool.hold(lease, held.given_up)
    items = iter_shard(shard.dataset, lease.start, lease.stop, done, ready.vocab_size, work.tokenizer,
                       work.options, suspects.rows, cell)
    held.size()
    run_extraction(ready.model, items, shard.plan, args.out, args.shard_index, shard.device, work.options, log,
                   held.stats, args.progress_interval, held.total, suspects, work.shipper, work.checks)
    if cell.lost:
        log.emit(protocol.WarningEvent(message=cell.lost + ": stopped them"))
        return True
    return False


def finish(shard: Shard, counts: ShardCounts, shipper: Shipper | None, gpus: list[torch.device]) -> None:
    """The shard's end once its rows are extracted: too many skipped fails it; its files (and its
    dead mates') land at the destination; speculators' prepared/ index; then `done`."""
    args = shard.args
    if problem := too_many_skipped(args.out, counts.counted, args.max_skip_fraction):
        raise NotRetryable(problem)
    if shipper is not None:
        shipper.finish(beat=counts.beat)
        ship_pool_leftovers(args, shard.layout, shipper, counts.beat)
    if args.format == "speculators" and (shipper is None or not shipper.dest.is_store):
        from .prepared import write_prepared   # issue 22: speculators train reads its rows here
        write_prepared(args.out if shipper is None else shipper.dest.remote)   # (all hosts' rows there)
    files.note_fatal(args.out, args.shard_index, None)
    shard.log.emit(protocol.Done(**counts.stats.snapshot(), total=counts.total(),
                                 host_peak_bytes=host_peak_bytes(), **gpu_memory(gpus)))


def pool_done(args: argparse.Namespace, log: EventLog, pool: Pool, shipper: Shipper | None, layout: Layout) -> int:
    """A launch that finds no rows left in its pool: done, with the counts of its finished leases
    (and, with a destination, once its files of earlier launches have landed)."""
    counted = pool.counted()
    pool.close()
    counts = ShardCounts(log, resumed_stats(load_finished(args.out), counted), counted)
    if shipper is not None:
        shipper.finish(beat=counts.beat)
        ship_pool_leftovers(args, layout, shipper, counts.beat)
    files.note_fatal(args.out, args.shard_index, None)
    log.emit(protocol.Done(**counts.stats.snapshot(), total=counts.total()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
