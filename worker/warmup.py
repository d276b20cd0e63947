"""The model made ready at load, before the first batch: the host's compile caches, the decoder
compiled where it pays and runs (else eager, saying why), a hybrid model's fla kernels tuned for
the shard's own batch shapes, and on a CPU the forwards timed that weigh rows for the ETA. Each
slow step is a LOADING event, so a compile is never read as a stall.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from . import protocol, sizing
from .batching import row_bucket
from .data import Dataset
from .events import EventLog
from .extract_args import make_options
from .identity import ModelShape
from .kernels import use_fast_kernels
from .model import (HYBRID_MODEL_TYPES, compile_layers, is_hybrid, missing_fast_kernels, uncompile_layers,
                    use_fla_conv)
from .rows import iter_shard
from .shard_exit import Terminated

if TYPE_CHECKING:
    from .tuning import Tuner


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


def start_tuner(args: argparse.Namespace, dataset: Dataset, start: int, stop: int, finished: set[int],
                device: torch.device, dtype: torch.dtype, shape: ModelShape, log: EventLog) -> Tuner | None:
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
                log: EventLog, pad: int, tuner: Tuner | None = None) -> str:
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
    fast = use_fast_kernels(model, device)            # the [fast] kernels, where they run (worker/kernels.py)
    compile_layers(model)
    if why := try_compiled(model, device, log, [(2, 2 * pad), (1, pad)]):   # a batch, and one row
        return why
    seconds = time.perf_counter() - t0
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    return (f"compiled ({seconds:.0f} s to compile{f', cache {cache}' if cache else ''})"
            + (f"; {fast}" if fast else ""))


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
                log: EventLog, pad: int, tuner: Tuner | None = None) -> str:
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
