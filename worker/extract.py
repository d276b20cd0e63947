"""`python -m worker.extract`: run one shard of a dataset through a causal LM and save hidden states.

Resumable (a restart skips everything in the output's manifests, whatever the shard count), atomic
(a kill at any moment leaves no file that `hs_*.safetensors` matches half-written), and fast:
length-sorted batches under a token budget, no attention mask (right padding under a causal mask
never reaches a real token, and repeats a token of the row), hooks on exactly the requested
layers, copies to the host on a side stream, a bounded background writer.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import resource
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from collections import Counter
from typing import Callable, Iterable

import torch

from . import __version__, files, inject, protocol, sizing
from .batching import make_batches, padded_length, row_bucket
from .data import BadRow, DataError, Sample, open_dataset, shard_range
from .events import EventLog
from .files import retry_skips, retryable
from .formats import (FORMATS, LOSS_MASK_CONVENTIONS, LOSS_MASKS, FormatError, Layout,
                      trainer_setting)
from .identity import (IdentityError, differences, model_shape, output_identity, output_mismatch,
                       upgraded, work_identity)
from .layers import LayerError, LayerPlan, choices, resolve_layers, yaml_max_length
from .launches import LaunchState
from .leases import Lease, LedgerError, Move, Pool, tell_taken
from .model import (HYBRID_MODEL_TYPES, Capture, ModelError, compile_layers, compute_dtype, find_decoder,
                    is_hybrid, load_model, missing_fast_kernels, model_devices, move, text_config,
                    uncompile_layers, unpacked_rows, use_fla_conv)
from .text import ranges_text
from .rows import Later, Options, iter_shard
from .reference import EVERY, MIN_ROWS, CheckFailed, ReferenceChecks
from .suspects import Suspects, suspects_path
from .ship import ShipError
from .text import bytes_text, parse_bytes
from .writer import (BackgroundWriter, DiskFullError, Manifest, OwnerError, Stats, claim_output,
                     load_finished, manifest_path, remove_stale_temps, write_json_atomic)

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_TERMINATED = 143


class Terminated(Exception):
    pass


class NotRetryable(Exception):
    """A failure that a restart would meet again (the work is not the run's, too many rows
    skipped): the failure event says so, and the judge gives up at once."""


class ForeignOutput(NotRetryable):
    """The output folder holds another run's work: nothing is written into it, not even the note
    that this shard stopped (that run's verify would read it as its own shard's)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = _argument_parser()
    return _checked_args(p, p.parse_args(argv))


def _argument_parser() -> argparse.ArgumentParser:
    """The command line, its flags in the order --help lists them."""
    p = argparse.ArgumentParser(
        prog="python -m worker.extract",
        description="Extract chosen intermediate hidden states of a Hugging Face causal LM over one "
                    "shard of a tokenized (or raw chat) dataset into hs_<index>.safetensors files.")
    for add in (_shard_arguments, _row_arguments, _device_arguments, _pipeline_arguments):
        add(p)
    return p


def _shard_arguments(p: argparse.ArgumentParser) -> None:
    """The model, the data, where the shard's output and record go, and which shard this is."""
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument("--data", required=True,
                   help="JSONL, Parquet or a save_to_disk folder; rows with input_ids [+ loss_mask] "
                        "or raw chats (ShareGPT conversations / OpenAI messages)")
    p.add_argument("--out", required=True, help="output folder for hs_<index>.safetensors")
    p.add_argument("--spill", action="append", default=[], metavar="FOLDER",
                   help="another disk's folder (repeatable): the samples' bytes go to --out and these in "
                        "turn, each with a link in --out, so a host writes at its disks' summed speed")
    p.add_argument("--state", default=None,
                   help="folder for events.jsonl (what fleet reads); default: no event file")
    p.add_argument("--shard-index", type=int, default=0)
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument("--pool", type=lambda v: [int(x) for x in v.split(",") if x.strip()], default=[],
                   help="the shards (comma list, this one included) that write --out on this host and "
                        "share their rows: a dead one's are finished by the others, and the last rows "
                        "of a slow one are split (worker/leases.py). Default: this shard alone")
    p.add_argument("--reference-checks", type=int, default=EVERY, metavar="N",
                   help=f"re-compute 1 in N rows (at least {MIN_ROWS} a shard) alone through the model's plain "
                        f"forward and compare with what was written; a row that differs stops the shard "
                        f"(worker/reference.py). 0: off. Default {EVERY}")
    p.add_argument("--destination", default=None,
                   help="ship each finished sample file to this place as the run goes on and delete it "
                        "here once it landed with a matching checksum: s3://bucket/prefix, "
                        "sftp://[user@]host/path or a path (worker/ship.py; needs rclone)")
    p.add_argument("--keep-local", type=parse_bytes, default=None, metavar="BYTES",
                   help="with --destination: the most bytes of this shard's files kept here; the writer "
                        "waits for shipping beyond it (e.g. 200GB)")


def _row_arguments(p: argparse.ArgumentParser) -> None:
    """What is written for each row (format, layers, loss mask), and how rows are batched and cut."""
    p.add_argument("--format", choices=FORMATS, default="speculators",
                   help="which trainer's files to write (default speculators: hs_<index>.safetensors)")
    p.add_argument("--layers", default=None,
                   help=f"{choices()} (default: the preset named like --format; eagle for eagle, "
                        f"specforge-dflash for specforge-dflash)")
    p.add_argument("--target-last-hidden-states", action="store_true",
                   help="specforge-dflash: also write hs[L] post-norm as target_last_hidden_states "
                        "(SpecForge DSpark; implied by a DSpark draft config)")
    p.add_argument("--loss-mask", choices=LOSS_MASKS, default="assistant",
                   help="raw chats: assistant (each assistant turn from the end of the generation "
                        "prompt through its end-of-turn token; default), assistant-content (the "
                        "message text only), all")
    p.add_argument("--last-layer-norm", choices=("pre", "post"), default=None,
                   help="for an explicit list holding L: raw last-layer output (pre, default) or "
                        "final-normed (post)")
    p.add_argument("--max-tokens-per-batch", type=int, default=16384)
    p.add_argument("--max-length", type=int, default=None, help="longest sample kept (tokens)")
    p.add_argument("--too-long", choices=("truncate", "skip"), default="skip",
                   help="what to do with a sample over --max-length (default skip, reported)")


def _device_arguments(p: argparse.ArgumentParser) -> None:
    """Where the model runs (one GPU, several, the CPU) and in which dtypes."""
    p.add_argument("--device", default=None, help="cuda:0 | cpu (default: cuda:0 when available)")
    p.add_argument("--gpus-per-shard", type=int, default=1,
                   help="spread the decoder layers over this many GPUs (cuda:0..k-1), for a model "
                        "that does not fit one")
    p.add_argument("--devices", default=None,
                   help="the devices to spread the layers over, as a comma list (overrides "
                        "--device and --gpus-per-shard; e.g. cpu,cpu tests the split without GPUs)")
    p.add_argument("--micro-batches", type=int, default=None,
                   help="split each batch into this many row groups issued back to back, so the GPUs "
                        "of a spread model work on different groups at once (default: one per GPU "
                        "of the shard; 1 when it has one GPU)")
    p.add_argument("--dtype", choices=("bf16", "fp8", "fp32"), default="bf16",
                   help="hidden states as stored: bf16 (default) or fp8 (float8_e4m3fn + a float32 "
                        "scale per token per layer, quantised on the GPU; format speculators). "
                        "fp32 is the old meaning of this flag: use --model-dtype fp32")
    p.add_argument("--model-dtype", choices=("bf16", "fp32"), default=None,
                   help="the model's compute dtype (default: bf16, or fp32 on a CPU without native "
                        "bf16, where a bf16 matmul is many times slower; the files keep --dtype)")


def _pipeline_arguments(p: argparse.ArgumentParser) -> None:
    """The writer and reader's bounds, progress, the run's plan and limits, compiling and caches."""
    p.add_argument("--writer-queue", type=int, default=3,
                   help="batches waiting for the disk before the GPU waits (bounds host memory)")
    p.add_argument("--writer-threads", type=int, default=4, help="files written in parallel")
    p.add_argument("--sort-window", type=int, default=20000,
                   help="samples read and length-sorted at a time (bounds host memory)")
    p.add_argument("--pad-multiple", type=int, default=None,
                   help="pad each batch's width to a multiple of this (default 8 on a GPU, 16 for a hybrid "
                        "model there, 1 on the CPU)")
    p.add_argument("--progress-interval", type=float, default=2.0, help="seconds between progress events")
    p.add_argument("--plan", default=None,
                   help="the run's plan.json (fleet passes it): refuse work whose identity differs")
    p.add_argument("--max-skip-fraction", type=float, default=0.01,
                   help="fail the shard when more than this fraction of its rows are skipped (default 0.01)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile at load: auto = on a GPU (dense models: whole decoder layers; hybrid "
                        "Gated DeltaNet models: their norms, MLPs and attention, fla's kernels eager), off on the CPU")
    p.add_argument("--cache-dir", default=None,
                   help="compile and Triton autotuning caches, shared by every run and shard of a host "
                        "(fleet passes <root>/cache): a launch pays no compile or tuning the host has paid before")
    p.add_argument("--random-weights", action="store_true",
                   help="initialise from config.json with random weights (benchmarks, dry runs)")


def _checked_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Refuse what argparse cannot (non-positive sizes, a shard out of range) through `p.error`,
    and read the old meaning of --dtype fp32."""
    if min(args.max_tokens_per_batch, args.writer_queue, args.writer_threads, args.pad_multiple or 1,
           args.micro_batches or 1) < 1:
        p.error("--max-tokens-per-batch, --writer-queue, --writer-threads, --pad-multiple and "
                "--micro-batches must be positive")
    if not 0 <= args.shard_index < args.num_shards:
        p.error(f"--shard-index {args.shard_index} out of range for --num-shards {args.num_shards}")
    if args.dtype == "fp32":               # --dtype used to be the model's dtype
        print("warning: --dtype fp32 means --model-dtype fp32 (--dtype is now the stored dtype, "
              "bf16 or fp8)", file=sys.stderr)
        args.dtype, args.model_dtype = "bf16", args.model_dtype or "fp32"
    return args


def gpu_memory(devices: torch.device | list[torch.device]) -> dict:
    """Allocated and peak bytes, summed over the shard's GPUs."""
    devices = [d for d in (devices if isinstance(devices, list) else [devices]) if d.type == "cuda"]
    if not devices:
        return {}
    return {"gpu_mem_bytes": sum(torch.cuda.memory_allocated(d) for d in devices),
            "gpu_peak_bytes": sum(torch.cuda.max_memory_allocated(d) for d in devices)}


def host_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def inject_bugs(hidden: torch.Tensor, batch: list[Sample]) -> None:
    """The content checks' test bugs (worker/inject.py), on the captured batch as the model gave it."""
    if inject.bug("zero-layer") and hidden.shape[2] > 1:
        hidden[:, :, 1] = 0                                    # one layer lost after the compiled region
    if inject.bug("swap-rows") and len(batch) > 1:
        hidden[[0, 1]] = hidden[[1, 0]].clone()                # two rows' states traded within the batch
    if inject.bug("pad-leak") and len(batch) > 1:
        r, T, S = len(batch) - 1, batch[-1].length, hidden.shape[1]
        if T < S:                                              # the shortest row takes its padding's states
            hidden[r, :T] = hidden[r, S - T:].clone()


class Extractor:
    """Runs batches through the model. A batch that fails (out of GPU memory, or any error a
    sample can cause) is split in halves down to the samples that fail; those, and the rows of a
    batch whose states came out non-finite, run once more after the rest, each alone (memory
    may be free by then; a padding row cannot touch them): only a row that fails alone is
    skipped, with the reason. One bad sample never costs the others, and a passing failure
    costs nothing."""

    def __init__(self, model: torch.nn.Module, plan: LayerPlan, device: torch.device,
                 writer: BackgroundWriter, pad_multiple: int, micro_batches: int = 1,
                 suspects: Suspects | None = None, checks: ReferenceChecks | None = None):
        self.model = model
        self.checks = checks
        self.later: list[Sample] = []        # retried alone after the rest
        self.suspects = suspects
        self.capture = Capture(find_decoder(model), plan)
        devices = model_devices(model, device)
        self.device, self.out_device = devices[0], devices[-1]   # ids go in here, states come out there
        self.writer = writer
        self.pad_multiple = pad_multiple
        self.micro_batches = micro_batches

    def run_batch(self, batch: list[Sample]) -> None:
        """A model spread over several GPUs takes each batch as `micro_batches` row groups issued
        back to back: nothing waits on the host, so stage i starts on group j+1 while stage i+1
        works on group j."""
        step = -(-len(batch) // self.micro_batches)
        for i in range(0, len(batch), step):
            self.run(batch[i:i + step])
        if self.checks is not None:
            self.checks.run(self.capture)          # rows chosen for a check, written since the last batch

    def run(self, batch: list[Sample]) -> None:
        problem = self._try(batch)
        if problem is None:
            return
        if len(batch) == 1:
            self.later.append(batch[0])
            return
        half = len(batch) // 2
        self.run(batch[:half])
        self.run(batch[half:])

    def run_later(self) -> None:
        """The rows that failed once (and the suspects of an earlier crash), each alone, after
        everything else is written; a row failing alone now is skipped with its reason."""
        while True:
            self.writer.flush()
            todo = sorted(self.later + self.writer.take_retries(), key=lambda s: s.index)
            self.later = []
            if not todo:
                return
            for sample in todo:
                if problem := self._try([sample], alone=True):
                    self.writer.skip(sample.index, f"{problem} (alone, after the rest)")

    def _try(self, batch: list[Sample], alone: bool = False) -> str | None:
        """None when the batch went through; else why it did not. `alone`: the last try of one
        row, run synchronously so that an error on the GPU shows on this row and no other."""
        if self.suspects is not None:
            self.suspects.starting([s.index for s in batch], alone)
        try:
            result = self._forward(batch)
            if alone and self.device.type == "cuda":
                for d in {self.device, self.out_device}:
                    torch.cuda.synchronize(d)
        except torch.cuda.OutOfMemoryError:
            problem = f"out of GPU memory at {max(s.length for s in batch)} tokens"
        except Terminated:
            raise
        except Exception as e:
            if "CUDA error" in str(e):       # a sticky device error: only a new process recovers
                raise
            line = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            problem = f"{type(e).__name__} in the forward pass: {line}"
        else:
            hidden, finite, lengths = result
            self.writer.submit(batch, hidden, finite, final=alone, lengths=lengths)   # (not a sample's error)
            return None
        self.capture.slots = [None] * len(self.capture.slots)   # outside the except: frames freed
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return problem

    def _inputs(self, batch: list[Sample], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [B, width] and lengths [B] on the device. On a GPU they go through one of two pinned
        staging buffers, asynchronously: the host never waits for the GPU here, so it queues the
        next batch while the GPUs work (with several GPUs, that is what keeps them all busy)."""
        B = len(batch)
        if self.device.type != "cuda":
            staged = torch.zeros(B * width + B, dtype=torch.long)
        else:
            slot = self._turn = (getattr(self, "_turn", 0) + 1) % 2
            buffers, events = self.__dict__.setdefault("_staging", [None, None]), \
                self.__dict__.setdefault("_staged", [None, None])
            if events[slot] is not None:
                events[slot].synchronize()                        # its copy (two batches ago) is done
            if buffers[slot] is None or buffers[slot].numel() < B * width + B:
                buffers[slot] = torch.empty(max(B * width + B, 1 << 16), dtype=torch.long, pin_memory=True)
            staged = buffers[slot][: B * width + B]
            staged.zero_()
        ids, lengths = staged[: B * width].view(B, width), staged[B * width:]
        for row, s in enumerate(batch):
            ids[row, : s.length] = torch.from_numpy(s.input_ids)
            ids[row, s.length:] = int(s.input_ids[-1])     # padding: a token the row already holds,
            lengths[row] = s.length                         # so a bad embedding cannot spoil it
        on_device = staged.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._staged[self._turn] = torch.cuda.Event()
            self._staged[self._turn].record(torch.cuda.current_stream(self.device))
        return on_device[: B * width].view(B, width), on_device[B * width:]

    def _forward(self, batch: list[Sample]) -> tuple[torch.Tensor, torch.Tensor]:
        width = padded_length(max(s.length for s in batch), self.pad_multiple)
        ids, lengths = self._inputs(batch, width)
        with torch.inference_mode(), unpacked_rows():            # no host sync in the forward
            self.model(input_ids=ids, use_cache=False)
            hidden = self.capture.take(self.out_device)          # [B, S, n, H] bf16
            inject_bugs(hidden, batch)
            out = self.out_device
            lengths = move(lengths, out)
            valid = torch.arange(width, device=out)[None, :] < lengths[:, None]
            bad = ~torch.isfinite(hidden).flatten(2).all(-1)     # [B, S]
            finite = ~(bad & valid).any(1)
        return hidden, finite, lengths


class ProgressTicker:
    """A progress event every `interval`, and one more as soon as the first batch is written:
    with `batches_from` (when it began) it times the first batch exactly, and the ETA's first
    figure rests on it."""

    def __init__(self, emit: Callable[[], None], stats: Stats, interval: float):
        self.emit, self.stats, self.interval = emit, stats, interval
        self.began = threading.Event()          # the first batch began: reading the rows is over
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress", daemon=True)

    def start(self) -> "ProgressTicker":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        last, first = time.monotonic(), self.stats.done + self.stats.skipped
        timing = True                           # waiting for the first batch's write
        while not self._stopped.wait(min(0.05, self.interval) if timing else
                                     max(self.interval - (time.monotonic() - last), 0.0)):
            if timing and self.began.is_set() and self.stats.done + self.stats.skipped > first:
                timing = False
            elif time.monotonic() - last < self.interval:
                continue
            self.emit()
            last = time.monotonic()


def feed(items: Iterable[list[Sample] | BadRow | Later], extractor: Extractor, writer: BackgroundWriter,
         log: EventLog, options: Options, began: threading.Event) -> None:
    """Every item through the extractor: a bad row recorded as skipped, the held-back suspects kept
    for after the rest, each chunk in length-sorted batches (the first one's start sent as
    `batches_from` on every later progress event)."""
    for item in items:
        if isinstance(item, BadRow):
            writer.skip(item.index, item.reason)
        elif isinstance(item, Later):
            extractor.later += item.samples
        else:
            for batch in make_batches(item, options.max_tokens_per_batch, options.pad_multiple,
                                      options.bucket_rows):
                if not began.is_set():
                    log.work = {**log.work, "batches_from": protocol.now()}
                    began.set()
                extractor.run_batch(batch)


def run_extraction(model: torch.nn.Module, items: Iterable[list[Sample] | BadRow | Later],
                   plan: LayerPlan, out_dir: str, shard: int, device: torch.device, options: Options,
                   log: EventLog, stats: Stats, progress_interval: float = 2.0,
                   total: int | Callable[[], int] = 0, suspects: Suspects | None = None,
                   shipper=None, checks: ReferenceChecks | None = None) -> Stats:
    """The GPU loop: sample chunks in, files out (in `options.format`); bad rows recorded as
    skipped; the chosen rows checked against the reference forward between batches (`checks`).
    Shared by the CLI and the benchmark."""
    os.makedirs(out_dir, exist_ok=True)
    layout = Layout(options.format, plan, options.dtype)
    devices = model_devices(model, device)
    writer = BackgroundWriter(
        out_dir, Manifest(manifest_path(out_dir, shard)), layout.header(), stats,
        depth=options.writer_queue, file_threads=options.writer_threads, device=devices[-1],
        on_skip=lambda index, reason: log.emit(protocol.SampleSkipped(index=index, reason=reason)),
        reserve_tokens=options.max_tokens_per_batch if device.type == "cuda" else 0, layout=layout,
        shipper=shipper, spill=options.spill, checks=checks)
    extractor = Extractor(model, plan, device, writer, options.pad_multiple,
                          options.micro_batches or len(devices), suspects, checks)
    def emit_progress() -> None:
        log.emit(protocol.Progress(total=total() if callable(total) else total, **stats.snapshot(),
                                   **gpu_memory(devices)))

    progress = ProgressTicker(emit_progress, stats, progress_interval).start()
    try:
        if suspects is not None and suspects.culprit is not None:
            writer.skip(suspects.culprit, "the worker process died while this row ran alone (a GPU "
                                          "error such as a device-side assert, or a kill)")
        feed(items, extractor, writer, log, options, progress.began)
        extractor.run_later()
        writer.close()
        if checks is not None:
            checks.run(extractor.capture)   # the last rows chosen
        if suspects is not None:
            suspects.settled()
    except Terminated:
        if suspects is not None:
            suspects.settled()              # a stop, not a crash: what ran was not to blame
        raise
    finally:
        progress.stop()
        extractor.capture.remove()
    emit_progress()                         # the last figures, after the last write
    return stats


def run_meta(layout: Layout, layers: str, loss_mask: str, out: str) -> dict:
    """What meta.json says about the files: format, where the trainer reads, layers, loss mask."""
    plan = layout.plan
    return {**layout.stored(), "format": layout.format, "data_dir": os.path.abspath(layout.data_dir(out)),
            "layers": layers, "layer_ids": list(plan.ids), "last_layer_norm": plan.last_layer_norm,
            "num_layers": plan.num_layers, "target_last_hidden_states": plan.target_last,
            "trainer_setting": trainer_setting(layout.format, plan, layout.dtype), "loss_mask": loss_mask,
            "loss_mask_convention": LOSS_MASK_CONVENTIONS[loss_mask]}


def write_meta(out_dir: str, meta: dict) -> None:
    """meta.json describes every file in the folder (check_identity has refused other work). It
    keeps the folder's `folder_id`, by which verify knows hosts that share one folder."""
    path = os.path.join(out_dir, protocol.META_FILE)
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = {}
    folder_id = old.get("folder_id") if isinstance(old, dict) else None
    write_json_atomic(path, {**meta, "folder_id": folder_id or uuid.uuid4().hex})


def main(argv: list[str] | None = None) -> int:
    """Run the shard: open it, claim its output, load the model, extract what is left of its
    rows; an error ends it with a failure event and an exit code that says what kind it was."""
    args = parse_args(argv)
    os.umask(os.umask(0o022) | 0o022)          # output and state never world- or group-writable
    log = EventLog(args.state, args.shard_index)
    signal.signal(signal.SIGTERM, _on_term)
    use_cache_dir(args.cache_dir)
    devices = shard_devices(args)
    device = torch.device(devices[0])
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dtype, dtype_note = compute_dtype(args.model_dtype, device)
        dataset, start, stop = _open_shard(args, log, device)
        shape, plan, layout = _resolve_work(args)
        identity = check_identity(args, plan)        # before any file is touched
        # `lock` is held for the process's life: one writer per output folder, one process per shard
        lock = _claim_output(args)
        shipper = _start_shipping(args, log, layout)
        pool = Pool(args.out, args.shard_index, pool_ranges(args, dataset.num_rows), dataset.num_rows)
        _retry_on_a_persons_launch(args, log)
        finished = load_finished(args.out)
        pool.reopen(lambda a, b: any(i not in finished for i in range(a, b)))   # rows a repair dropped
        lease = pool.own()
        if lease is None and pool.empty():           # its rows were done by the others: no model load
            return _pool_done(args, log, pool, shipper, layout)
        log.emit(protocol.Loading(model=args.model))
        t0 = time.perf_counter()
        _check_gpus_visible(device, devices)
        first = lease or Lease(start, stop, 0, start)
        tuner = start_tuner(args, dataset, first.start, first.stop, set(finished), device, dtype, shape, log)
        model = load_model(args.model, devices, dtype, args.random_weights, interval=args.progress_interval,
                           on_read=lambda done, total, rate: log.emit(protocol.Loading(
                               model=args.model, detail=f"reading the weights: {bytes_text(done)} of "
                                                        f"{bytes_text(total)} ({bytes_text(rate)}/s)")))
        shard_gpus = model_devices(model, device)
        vocab_size = model.get_input_embeddings().num_embeddings
        config = text_config(model)
        pad = args.pad_multiple or (1 if device.type != "cuda" else HYBRID_PAD if is_hybrid(model) else 8)
        path = "; ".join(filter(None, (choose_path(model, device, args, log, max(8, pad), tuner), dtype_note)))
        weight, cpu_rate = host_weight(model, device, args, log, config, shape.max_positions)
        log.emit(protocol.Loaded(seconds=round(time.perf_counter() - t0, 2), **gpu_memory(shard_gpus),
                                 layer_ids=list(plan.ids), last_layer_norm=plan.last_layer_norm,
                                 path=path, cpu_tokens_per_s=cpu_rate))
        if warning := missing_fast_kernels(model):
            log.emit(protocol.WarningEvent(message=warning))
        _write_run_meta(args, config, dtype, layout, dataset.num_rows, identity)
        options = make_options(args, shape, pad)
        tokenizer = chat_tokenizer(args.model)
        how, source, origin, counted = "plan", None, None, pool.counted()
        sizer = sizing.Sizer(log, dataset, vocab_size, args.model, options, config, weight)
        stats = resumed_stats(load_finished(args.out), counted)
        checks = ReferenceChecks(model, layout, args.out, args.shard_index, args.reference_checks, stop - start,
                                 log.emit, path, tokenizer, args.loss_mask) if args.reference_checks > 0 else None
        lost = False
        def waiting() -> None:                     # a progress tick while it waits for a lease
            log.emit(protocol.Progress(**stats.snapshot(), total=sum(b - a for a, b in counted)))
        while lease is not None or (got := pool.next(beat=waiting)) is not None:
            if lease is None:
                lease, move = got
                how, source, origin = move.how, (move.source if move.source >= 0 else None), move.origin
                if move.how == "dead":
                    _tell_source(args, move, pool.counted_for(move.source))
            held = Holding(args.out, lease, pool.counted(), log, sizer.start, tuple(args.spill))
            log.emit(protocol.Leased(start=lease.start, stop=lease.stop, rows=held.owed, epoch=lease.epoch,
                                     how=how, from_shard=source, from_host=origin))
            suspects = Suspects(suspects_path(args.out, args.shard_index), set(held.finished), lease.start,
                                lease.stop)
            done = set(held.finished) | ({suspects.culprit} if suspects.culprit is not None else set())
            cell = pool.hold(lease, held.given_up)
            items = iter_shard(dataset, lease.start, lease.stop, done, vocab_size, tokenizer, options,
                               suspects.rows, cell)
            held.size()
            stats = run_extraction(model, items, plan, args.out, args.shard_index, device, options, log,
                                   held.stats, args.progress_interval, held.total, suspects, shipper, checks)
            if cell.lost:                          # moved away (its host was lost): stop them, go on
                log.emit(protocol.WarningEvent(message=cell.lost + ": stopped them"))
                lost = True
            pool.finish()
            counted, lease = pool.counted() if lost else held.ranges, None
        pool.close()
        if lost:                                   # what counts for it is what the ledger says now
            stats = resumed_stats(load_finished(args.out), counted)
        if problem := too_many_skipped(args.out, counted, args.max_skip_fraction):
            raise NotRetryable(problem)
        if shipper is not None:
            shipper.finish(beat=waiting)
            _ship_leftovers(args, layout, shipper, waiting)
        if args.format == "speculators" and (shipper is None or not shipper.dest.is_store):
            from .prepared import write_prepared   # issue 22: speculators train reads its rows here
            write_prepared(args.out if shipper is None else shipper.dest.remote)   # (all hosts' rows there)
        files.note_fatal(args.out, args.shard_index, None)
        log.emit(protocol.Done(**stats.snapshot(), total=sum(b - a for a, b in counted),
                               host_peak_bytes=host_peak_bytes(), **gpu_memory(shard_gpus)))
        lock.close()
        return 0
    except (Exception, KeyboardInterrupt) as e:
        if isinstance(e, (NotRetryable, CheckFailed)) and not isinstance(e, ForeignOutput):  # verify reads it
            files.note_fatal(args.out, args.shard_index, str(e))
        return _failure_exit(log, e)


def _on_term(signum, frame):
    """SIGTERM (a stop, a restart, Slurm's end) as an exception: the shard ends through main's handler."""
    raise Terminated(f"terminated by signal {signum}")


def shard_devices(args: argparse.Namespace) -> list[str]:
    """The devices the model's layers are spread over: --devices; else cuda:0..k-1 for
    --gpus-per-shard k on a GPU; else the one device (--device, or cuda:0 when there is one)."""
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    return args.devices.split(",") if args.devices else \
        [f"cuda:{i}" for i in range(args.gpus_per_shard)] if device.type == "cuda" and args.gpus_per_shard > 1 \
        else [str(device)]


def _open_shard(args: argparse.Namespace, log: EventLog, device: torch.device):
    """The dataset and this shard's rows [start, stop), announced by the `started` event."""
    dataset = open_dataset(args.data)
    if dataset.num_rows == 0:
        raise DataError(f"{args.data}: empty (0 rows)")
    start, stop = shard_range(dataset.num_rows, args.num_shards, args.shard_index)
    log.emit(protocol.Started(pid=os.getpid(), host=socket.gethostname(), device=str(device),
                              shard=args.shard_index, num_shards=args.num_shards, start=start,
                              stop=stop, total=stop - start, num_rows=dataset.num_rows))
    return dataset, start, stop


def _resolve_work(args: argparse.Namespace):
    """The model's shape (from its config.json), the layers to capture and the files' layout."""
    shape = model_shape(args.model)
    if shape is None:
        raise ModelError(f"{args.model}: " + ("no config.json with hidden_size and num_hidden_layers"
                                               if os.path.isdir(args.model) else "model folder not found"))
    plan = resolve_layers(args.layers or args.format, shape.num_layers,
                          args.last_layer_norm, args.target_last_hidden_states)
    return shape, plan, Layout(args.format, plan, args.dtype)


def _claim_output(args: argparse.Namespace):
    """The output folder claimed for the run's plan (the lock returned must be kept open)."""
    planned = read_plan_file(args.plan) if args.plan else {}
    for folder in args.spill:                  # another run's spill folder is refused like its output
        claim_output(folder, planned.get("run"), planned.get("created"), args.shard_index)
    return claim_output(args.out, planned.get("run"), planned.get("created"), args.shard_index)


def pool_ranges(args: argparse.Namespace, num_rows: int) -> dict[int, tuple[int, int]]:
    """The planned rows of each shard of this shard's pool (--pool; alone: its own)."""
    members = sorted({args.shard_index, *args.pool})
    return {k: shard_range(num_rows, args.num_shards, k) for k in members}


class Holding:
    """This shard's counts while it holds `lease`, as before leases for one range: the finished
    rows (by any launch) of the leases that count for it and of this one, out of their rows; a
    steal takes its rows out of both, and `size` has them sized (the ETA's tokens) again."""

    def __init__(self, out_dir: str, lease: Lease, counted: list[tuple[int, int]], log: EventLog,
                 sizer: Callable[[list[tuple[int, int]]], object] = lambda ranges: None,
                 spill: tuple[str, ...] = ()):
        remove_stale_temps(out_dir, lease.start, lease.stop, spill)    # a dead holder's leftovers too
        self.finished = load_finished(out_dir)
        self.ranges = [*counted, (lease.start, lease.stop)]
        self.stats = resumed_stats(self.finished, self.ranges)
        self.rows = sum(b - a for a, b in self.ranges)
        self.owed = sum(1 for i in range(lease.start, lease.stop) if i not in self.finished)
        self.log, self.sizer = log, sizer

    def total(self) -> int:
        return self.rows

    def size(self) -> None:
        """Have the rows that count for this shard now sized, in the background."""
        self.sizer(list(self.ranges))

    def given_up(self, move: Move) -> None:
        """A steal took rows [move.start, move.stop), none of them read yet."""
        gone = [self.finished[i] for i in range(move.start, move.stop) if i in self.finished]
        with self.stats.lock:
            self.rows -= move.stop - move.start
            self.stats.done -= sum(1 for r in gone if "skipped" not in r)
            self.stats.skipped -= sum(1 for r in gone if "skipped" in r)
        self.ranges[-1] = (self.ranges[-1][0], move.start)
        self.log.emit(protocol.LeaseMoved(start=move.start, stop=move.stop, to_shard=move.target, why="stolen",
                                          rows=move.stop - move.start - len(gone), total=self.rows, holds=True))
        self.size()


def _tell_source(args: argparse.Namespace, move: Move, counted: list[tuple[int, int]]) -> None:
    """A dead shard's lease taken over: said in its own record (leases.tell_taken), with the
    counts of the leases that still count for it."""
    if not args.state or os.path.basename(os.path.dirname(os.path.abspath(args.state))) != "shards":
        return
    finished = load_finished(args.out)
    stats = resumed_stats(finished, counted)
    tell_taken(os.path.dirname(os.path.abspath(args.state)), move,
               sum(1 for i in range(move.start, move.stop) if i not in finished),
               sum(b - a for a, b in counted), stats.done, stats.skipped)


def _retry_on_a_persons_launch(args: argparse.Namespace, log: EventLog) -> None:
    """A launch a person asked for (r, fleet restart, fleet up on a FATAL shard) retries the rows
    this shard skipped for failures that may pass (out of memory alone, a GPU error): they judged
    the cause gone. The policy's own restarts do not."""
    if not args.state or LaunchState.read(os.path.join(args.state, protocol.EVENTS_FILE)).by != "manual":
        return
    if rows := retry_skips(args.out, args.shard_index):
        log.emit(protocol.WarningEvent(message=f"retrying {len(rows)} row(s) skipped for failures that may "
                                               f"pass ({ranges_text(rows)}): a launch by hand"))


def _pool_done(args: argparse.Namespace, log: EventLog, pool: Pool, shipper, layout: Layout) -> int:
    """A launch that finds no rows left in its pool: done, with the counts of its finished leases
    (and, with a destination, once its files of earlier launches have landed)."""
    counted = pool.counted()
    pool.close()
    stats = resumed_stats(load_finished(args.out), counted)
    if shipper is not None:
        beat = lambda: log.emit(protocol.Progress(**stats.snapshot(), total=sum(b - a for a, b in counted)))  # noqa: E731
        shipper.finish(beat=beat)
        _ship_leftovers(args, layout, shipper, beat)
    files.note_fatal(args.out, args.shard_index, None)
    log.emit(protocol.Done(**stats.snapshot(), total=sum(b - a for a, b in counted)))
    return 0


def _ship_leftovers(args: argparse.Namespace, layout: Layout, shipper, beat: Callable[[], None]) -> None:
    """At its end a shard ships what its pool's dead mates left on the disk (ship.ship_leftovers),
    each mate's figures told in that mate's own record."""
    shards = os.path.dirname(os.path.abspath(args.state)) if args.state else None
    def emit_for(k: int) -> Callable[[protocol.Shipping], None]:
        if not shards or os.path.basename(shards) != "shards":
            return lambda ev: None
        return lambda ev: protocol.append_jsonl(os.path.join(shards, str(k), protocol.EVENTS_FILE), ev)
    from .ship import ship_leftovers
    ship_leftovers(args.out, shipper.dest, set(args.pool) - {args.shard_index},
                   lambda i: layout.path(args.out, i), emit_for, beat, tuple(args.spill))


def _start_shipping(args: argparse.Namespace, log: EventLog, layout: Layout):
    """With --destination: the shard's Shipper, its files of earlier launches counted, running."""
    if not args.destination:
        return None
    from .files import manifest_entries
    from .ship import ShipError, Shipper, destination, owner_problem
    dest = destination(args.destination)
    run = (read_plan_file(args.plan) if args.plan else {}).get("run")
    if run and (problem := owner_problem(dest, run)):   # (preflight refused it; another run since?)
        raise ShipError(problem)
    mine = os.path.basename(manifest_path(args.out, args.shard_index))
    records = [rec for name, rec in manifest_entries(args.out) if name == mine]
    return Shipper(args.out, dest, args.shard_index,
                   lambda i: layout.path(args.out, i), args.keep_local, log.emit, tuple(args.spill)).resume(records)


def _check_gpus_visible(device: torch.device, devices: list[str]) -> None:
    if device.type == "cuda" and len(devices) > torch.cuda.device_count():
        raise ModelError(f"--gpus-per-shard {len(devices)}: only {torch.cuda.device_count()} GPU(s) "
                         f"visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')})")


def _write_run_meta(args: argparse.Namespace, config, dtype: torch.dtype, layout: Layout, num_rows: int,
                    identity: protocol.WorkIdentity) -> None:
    """meta.json: what the output holds and what made it (the trainers and verify read it)."""
    os.makedirs(args.out, exist_ok=True)
    write_meta(args.out, {
        "model": os.path.abspath(args.model), "model_type": config.model_type,
        "model_dtype": str(dtype).removeprefix("torch."),
        **run_meta(layout, args.layers or args.format, args.loss_mask, args.out),
        "hidden_size": config.hidden_size,
        "num_samples": num_rows, "data": os.path.abspath(args.data),
        "random_weights": args.random_weights, "identity": identity.to_dict(),
        "max_length": args.max_length or yaml_max_length(args.layers),   # the window the mask was judged in
        "max_skip_fraction": args.max_skip_fraction,                     # what verify allows too
        "versions": {"worker": __version__, "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__,
                     "safetensors": __import__("safetensors").__version__}})


def resumed_stats(finished: dict[int, dict], ranges: list[tuple[int, int]]) -> Stats:
    """The shard's counters over its rows `ranges` as the manifests leave them: a resumed launch,
    or a new lease, counts on from there."""
    stats = Stats()
    in_range = [rec for i, rec in finished.items() if any(a <= i < b for a, b in ranges)]
    stats.done = sum(1 for r in in_range if "skipped" not in r)
    stats.skipped = len(in_range) - stats.done
    stats.tokens = sum(r.get("tokens", 0) for r in in_range)
    stats.sq_tokens = sum(r.get("tokens", 0) ** 2 for r in in_range)
    stats.bytes = sum(r.get("bytes", 0) for r in in_range)
    return stats


def chat_tokenizer(model: str) -> Callable:
    """The model's tokenizer, loaded on first use (only raw chat rows need it), once."""
    @functools.cache
    def tokenizer():
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError) as e:
            raise ModelError(f"{model}: raw chat rows need the model's tokenizer, which "
                             f"did not load: {str(e).splitlines()[0]}") from None
    return tokenizer


def _failure_exit(log: EventLog, e: BaseException) -> int:
    """The failure event and exit code for what ended the shard: fatal where a restart would fail
    the same way (exit 1), a user's error (exit 2), a stop (143; quiet when one was asked for)."""
    if isinstance(e, (NotRetryable, CheckFailed, OwnerError, LedgerError)):   # (a restart reads the same)
        return fail(log, str(e), EXIT_FAILED, fatal=True)
    if isinstance(e, (DataError, ModelError, LayerError, FormatError, ShipError)):
        return fail(log, str(e), EXIT_USAGE, fatal=getattr(e, "fatal", False))
    if isinstance(e, DiskFullError):
        return fail(log, str(e), EXIT_FAILED)
    if isinstance(e, Terminated):
        if asked := log.stop_requested():
            print(f"stopped: {e} ({'a restart' if asked.why == 'restart' else 'asked by the user'}); "
                  f"what was written stays, the next launch resumes", file=sys.stderr, flush=True)
            return EXIT_TERMINATED
        return fail(log, str(e), EXIT_TERMINATED)
    if isinstance(e, KeyboardInterrupt):
        return fail(log, "interrupted", EXIT_TERMINATED)
    why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if "CUDA error" in str(e):        # sticky: only a new process recovers (worker.suspects)
        why += " (the rows in flight run alone, after the rest, at the next launch)"
    return fail(log, why, EXIT_FAILED, traceback.format_exc())


def use_cache_dir(cache_dir: str | None) -> None:
    """Point Inductor's and Triton's caches (and Triton's autotuning results, fla's included) at
    the host's shared folder (every run and shard of the host); set before anything compiles.
    The flag wins over an inherited environment (torch exports its default cache folder to its
    children)."""
    if not cache_dir:
        return
    os.makedirs(cache_dir, exist_ok=True)
    for var, value in (("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir, "inductor")),
                       ("TRITON_CACHE_DIR", os.path.join(cache_dir, "triton")),
                       ("TORCHINDUCTOR_FX_GRAPH_CACHE", "1"), ("TORCHINDUCTOR_AUTOGRAD_CACHE", "1"),
                       ("TRITON_CACHE_AUTOTUNING", "1")):
        os.environ[var] = value


# Hybrid models on a GPU: batch widths a multiple of 16 (fla's kernels tune per model shape, not
# per width; the row buckets and widths of 64 that kept their tuning few cost 7% of padding).
HYBRID_PAD = 16


def make_options(args: argparse.Namespace, shape, pad: int) -> Options:
    return Options(args.max_tokens_per_batch, args.max_length, args.too_long,
                   args.writer_queue, args.writer_threads, args.sort_window,
                   pad_multiple=pad, loss_mask=args.loss_mask, format=args.format,
                   max_positions=shape.max_positions, dtype=args.dtype,
                   micro_batches=args.micro_batches, window=yaml_max_length(args.layers),
                   spill=tuple(args.spill))


def start_tuner(args: argparse.Namespace, dataset, start: int, stop: int, finished: set[int],
                device: torch.device, dtype: torch.dtype, shape, log: EventLog):
    """A hybrid (Gated DeltaNet) model on a GPU with fla: fla's kernels tuned for this shard's
    own batch shapes (its first read window's rows) in a thread beside the weights' build
    (worker.tuning), each step a LOADING event. None where there is nothing to tune."""
    import importlib.util
    if device.type != "cuda" or args.compile == "off" or importlib.util.find_spec("fla") is None:
        return None
    try:
        from transformers import AutoConfig
        config = AutoConfig.from_pretrained(args.model)
    except Exception:
        return None
    text = getattr(config, "text_config", None) or config
    if getattr(text, "model_type", "") not in HYBRID_MODEL_TYPES:
        return None
    from .tuning import Tuner, install
    install()
    options = make_options(args, shape, args.pad_multiple or HYBRID_PAD)

    @functools.cache
    def tokenizer():
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(args.model)

    def lengths() -> list[int]:
        vocab = getattr(text, "vocab_size", None) or 1 << 62
        for item in iter_shard(dataset, start, stop, finished, vocab, tokenizer, options):
            if isinstance(item, list):
                return [s.length for s in item]          # the first read window: the first batches
        return []

    shown = [0.0]

    def report(i: int, n: int) -> None:
        now = time.perf_counter()
        if i == 0 or i == n - 1 or now - shown[0] > 1.0:
            shown[0] = now
            what = "the shard's main batch shape (the kernels tune here)" if i == 0 else "batch shape"
            log.emit(protocol.Loading(model=args.model, detail=f"tuning fla's kernels for this shard: "
                                                               f"{what} {i + 1} of {n}"))
    return Tuner(config, device, dtype, lengths, args.max_tokens_per_batch, options.pad_multiple,
                 False, report).start()


def choose_path(model: torch.nn.Module, device: torch.device, args: argparse.Namespace,
                log: EventLog, pad: int, tuner=None) -> str:
    """Compile the decoder layers where it pays and can run, warming them up at load (so the
    compile shows as LOADING "compiling", never as a stall); fall back to eager, saying why."""
    if args.compile == "off":
        return "eager (--compile off)"
    if args.compile == "auto" and device.type != "cuda":
        return "eager (no GPU: compiling would cost more than it saves)"
    if is_hybrid(model):
        return warm_hybrid(model, device, args, log, pad, tuner)
    if not hasattr(torch, "compile"):
        return f"eager (torch {torch.__version__} has no torch.compile)"
    log.emit(protocol.Loading(model=args.model, detail="compiling the decoder layers"))
    t0 = time.perf_counter()
    compile_layers(model)
    if why := try_compiled(model, device, log, [(2, 2 * pad), (1, pad)]):   # a batch, and one row
        return why
    seconds = time.perf_counter() - t0
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return f"compiled ({seconds:.0f} s to compile{f', cache {cache}' if cache else ''})"


def try_compiled(model: torch.nn.Module, device: torch.device, log: EventLog,
                 shapes: list[tuple[int, int]]) -> str | None:
    """Run the compiled model on `shapes` (rows, width); on any failure (no compiler, an
    unsupported op...) back to eager with a warning: the path to report, else None."""
    try:
        warm_rows(model, device, shapes)
    except Exception as e:
        uncompile_layers(model)
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        log.emit(protocol.WarningEvent(message=f"torch.compile failed, running eager: {type(e).__name__}: {why}"))
        return f"eager (torch.compile failed: {type(e).__name__})"
    return None


def warm_hybrid(model: torch.nn.Module, device: torch.device, args: argparse.Namespace,
                log: EventLog, pad: int, tuner=None) -> str:
    """A hybrid (Gated DeltaNet) model: fla's kernels are being tuned for the shard's own batch
    shapes in the `tuner`'s thread (worker.tuning: once per kernel, at the shard's main shape,
    reused across sizes), started before the weights were built. Meanwhile the parts of each
    layer that hold no fla kernel are compiled (`compile_regions`), their first forwards run with
    the linear-attention blocks set aside; then, the tuning done, one more small forward of
    each kind compiles what is left (the gated norms inside those blocks, fla's specialisations),
    with the blocks' q, k and v projected apart where that checks out against their own forward
    (worker.gdn: no copies before fla's kernels). The compiled code and the tuning land in the
    host's cache (--cache-dir) for every later process of the host."""
    from .gdn import split_projections
    from .model import compile_regions
    from .tuning import install, linear_attention_aside, tuning_report
    missing = missing_fast_kernels(model)
    conv = ", fla's causal conv" if device.type == "cuda" and use_fla_conv(model) else ""
    install()                                     # brief timing, one tuning per kernel, every size
    shapes = [(2, 2 * pad), (1, pad)]             # a batch, and one row
    compile_s, why, regions = 0.0, None, 0
    if hasattr(torch, "compile"):                 # --compile on, or auto on a GPU
        busy = tuner is not None and tuner.is_alive()
        log.emit(protocol.Loading(model=args.model, detail="compiling the norms, MLPs and attention (the "
                 "linear-attention kernels stay eager)" + (", beside fla's tuning" if busy else "")))
        t0 = time.perf_counter()
        regions = compile_regions(model)
        if busy:
            with linear_attention_aside(model):
                why = try_compiled(model, device, log, shapes)
        compile_s = time.perf_counter() - t0
    tuned = ""
    if tuner is not None:
        t0 = time.perf_counter()
        tuner.join()
        if tuner.error is not None:
            e = tuner.error
            log.emit(protocol.WarningEvent(message=f"tuning fla's kernels at load failed ({type(e).__name__}: "
                                                   f"{str(e).strip()[:200]}): they tune on first use"))
        elif tuner.ran:
            tuned = (f", tuned for the shard's {len(tuner.shapes)} batch shapes in {tuner.seconds:.0f} s from "
                     f"the load's start (then waited {time.perf_counter() - t0:.0f} s)")
    split = split_projections(model)     # fla's kernels tuned by now: the check may run them
    if hasattr(torch, "compile") and why is None:
        t0 = time.perf_counter()
        why = try_compiled(model, device, log, shapes)
        compile_s += time.perf_counter() - t0
    compiled = ""
    if why:
        compiled = f", {why.removeprefix('eager (').removesuffix(')')}"
    elif hasattr(torch, "compile"):
        compiled = f", {regions} norm/MLP/attention modules compiled in {compile_s:.0f} s"
    if device.type != "cuda" or missing:
        return "eager (hybrid model" + (": fast kernels missing" if missing else "") + f"{conv}{split}{compiled})"
    return f"fla's kernels{conv}{split}{tuned} ({tuning_report()}){compiled}"


def row_buckets(budget: int, pad: int) -> list[int]:
    """Every row count a batch can have under `budget` with bucketed rows."""
    return sorted({row_bucket(r) for r in range(1, max(1, budget // pad) + 1)})


def host_weight(model: torch.nn.Module, device: torch.device, args: argparse.Namespace, log: EventLog,
                config, max_positions: int | None) -> tuple[float | None, float | None]:
    """Attention's weight for the ETA as this CPU runs the model (sizing.measured_weight, 1-3 s at
    load on the demo, shown as its own LOADING step), and the tokens/s of the forwards it timed:
    on a CPU the run's expected figure when fleet.toml gives none (what this machine does, not
    what another did). (None, None) on a GPU; a weight of None when the timing says nothing (the
    FLOP model's weight then)."""
    if device.type != "cpu":
        return None, None
    log.emit(protocol.Loading(model=args.model, detail="timing a long row against short ones "
                                                       "(what the ETA weighs rows by)"))
    long = min(sizing.LONG_ROW, max_positions or sizing.LONG_ROW)
    timed: list[tuple[int, float]] = []

    def forward(rows: int, width: int) -> float:
        seconds = warm_rows(model, device, [(rows, width)])
        timed.append((rows * width, seconds))
        return seconds
    try:
        weight = sizing.measured_weight(forward, sizing.attention_weight(config), long=long)
    except Terminated:
        raise
    except Exception:           # a timing that fails costs the ETA its measured weight, never the shard
        return None, None
    spent = timed[1:]           # (the first forward is measured_weight's untimed warm-up)
    seconds = sum(s for _, s in spent)
    return weight, (round(sum(n for n, _ in spent) / seconds, 1) if spent and seconds > 0 else None)


def warm_rows(model: torch.nn.Module, device: torch.device, shapes: list[tuple[int, int]],
              step: Callable[[int], None] | None = None) -> float:
    """One forward of zeros per (rows, width) shape (kernels compile and tune on first sight of
    a shape), `step(i)` before the i-th; seconds."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i, (rows, width) in enumerate(shapes):
            if step:
                step(i)
            model(input_ids=torch.zeros((rows, width), dtype=torch.long, device=device), use_cache=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def check_identity(args: argparse.Namespace, plan: LayerPlan) -> protocol.WorkIdentity:
    """This shard's work as worker.identity sees it; NotRetryable when it is not the run's plan's
    or not what the output folder already holds (another model, dataset, layers or format)."""
    try:
        identity = work_identity(args.model, args.data,
                                 output_identity(plan, args.format, args.loss_mask, args.dtype))
    except IdentityError as e:
        raise ModelError(str(e)) from None
    if args.plan:
        planned = read_plan_file(args.plan).get("identity") or {}
        if diffs := differences(upgraded(planned), identity):
            raise NotRetryable(f"this shard's work differs from the run's plan ({args.plan}): "
                               + "; ".join(diffs) + " (fleet up --replan after fleet down, or restore it)")
    if diffs := output_mismatch(args.out, identity):
        raise ForeignOutput(f"{args.out} holds another run's work (its meta.json): " + "; ".join(diffs)
                           + ": use another --out")
    return identity


def read_plan_file(path: str) -> dict:
    try:
        with open(path) as f:
            plan = json.load(f)
        if not isinstance(plan, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read the run's plan: {e}") from None
    return plan


def too_many_skipped(out_dir: str, ranges: list[tuple[int, int]], limit: float) -> str | None:
    """Nothing counts as done that did nothing: more than `limit` of the shard's rows (`ranges`)
    skipped fails it, with the count and the commonest reasons."""
    skipped = [r["skipped"] for i, r in load_finished(out_dir).items()
               if "skipped" in r and any(a <= i < b for a, b in ranges)]
    rows = sum(b - a for a, b in ranges)
    if not rows or len(skipped) <= limit * rows:
        return None
    reasons = Counter(re.sub(r"\d{2,}|(?<=\[)\d+(?=\])", "N", why) for why in skipped).most_common(3)
    passing = sum(1 for why in skipped if retryable(why))
    way = (f"; {passing} of them failed alone (out of memory, a GPU error): once the cause is gone, a "
           f"restart by hand (r, or fleet restart) retries them" if passing else
           "; fix those rows or raise max_skip_fraction (fleet verify lists them)")
    return (f"skipped {len(skipped)} of {rows} rows ({len(skipped) / rows:.1%} > max_skip_fraction "
            f"{limit:g}): " + "; ".join(f"{why} ({n})" for why, n in reasons) + way)


def fail(log: EventLog, reason: str, code: int, tb: str = "", fatal: bool = False) -> int:
    tail = tb.strip().splitlines()[-12:] if tb else []
    log.emit(protocol.Failed(reason=reason, exit_code=code, traceback=tail, fatal=fatal))
    print(f"error: shard {log.shard}: {reason}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
