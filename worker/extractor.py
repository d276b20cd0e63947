"""The GPU loop of a shard: sample chunks in, files out. Length-sorted batches run through the
model with hooks on exactly the requested layers, their states copied to the host on a side stream
and handed to a bounded background writer; a batch that fails is split down to the rows that fail,
and those run alone after the rest. Shared by `python -m worker.extract` and the benchmarks.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from typing import Callable, Iterable

import torch

from . import inject, protocol
from .batching import make_batches, padded_length
from .data import BadRow, Sample
from .events import EventLog
from .formats import Layout
from .layers import LayerPlan
from .model import Capture, find_decoder, model_devices, move, unpacked_rows
from .reference import ReferenceChecks
from .rows import Later, Options
from .shard_exit import Terminated
from .ship import Shipper
from .suspects import Suspects
from .writer import BackgroundWriter, Manifest, Stats, manifest_path


def gpu_memory(devices: torch.device | list[torch.device]) -> dict:
    """Allocated and peak bytes, summed over the shard's GPUs."""
    devices = [d for d in (devices if isinstance(devices, list) else [devices]) if d.type == "cuda"]
    if not devices:
        return {}
    return {"gpu_mem_bytes": sum(torch.cuda.memory_allocated(d) for d in devices),
            "gpu_peak_bytes": sum(torch.cuda.max_memory_allocated(d) for d in devices)}


def host_peak_bytes() -> int:
    """The process's peak resident memory (ru_maxrss is in KiB on Linux)."""
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
        self._turn = 0                                              # the staging slot last used
        self._staging: list[torch.Tensor | None] = [None, None]     # pinned host buffers (GPU only)
        self._staged: list[torch.cuda.Event | None] = [None, None]  # each buffer's copy to the GPU

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
            slot = self._turn = (self._turn + 1) % 2
            copied, buffer = self._staged[slot], self._staging[slot]
            if copied is not None:
                copied.synchronize()                              # its copy (two batches ago) is done
            if buffer is None or buffer.numel() < B * width + B:
                buffer = self._staging[slot] = torch.empty(max(B * width + B, 1 << 16), dtype=torch.long,
                                                           pin_memory=True)
            staged = buffer[: B * width + B]
            staged.zero_()
        ids, lengths = staged[: B * width].view(B, width), staged[B * width:]
        for row, s in enumerate(batch):
            ids[row, : s.length] = torch.from_numpy(s.input_ids)
            ids[row, s.length:] = int(s.input_ids[-1])     # padding: a token the row already holds,
            lengths[row] = s.length                         # so a bad embedding cannot spoil it
        on_device = staged.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            copying = self._staged[self._turn] = torch.cuda.Event()
            copying.record(torch.cuda.current_stream(self.device))
        return on_device[: B * width].view(B, width), on_device[B * width:]

    def _forward(self, batch: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's captured states [B, S, n, H], whether each row's real tokens came out
        finite [B], and the rows' lengths [B], all on the last device."""
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
                   shipper: Shipper | None = None, checks: ReferenceChecks | None = None) -> Stats:
    """The GPU loop: sample chunks in, files out (in `options.format`); bad rows recorded as
    skipped; the chosen rows checked against the reference forward between batches (`checks`).
    Shared by the CLI and the benchmark."""
    os.makedirs(out_dir, exist_ok=True)

    def skipped(index: int, reason: str) -> None:
        log.emit(protocol.SampleSkipped(index=index, reason=reason))

    layout = Layout(options.format, plan, options.dtype)
    devices = model_devices(model, device)
    writer = BackgroundWriter(
        out_dir, Manifest(manifest_path(out_dir, shard)), layout.header(), stats,
        depth=options.writer_queue, file_threads=options.writer_threads, device=devices[-1],
        on_skip=skipped,
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
