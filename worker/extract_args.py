"""The command line of `python -m worker.extract`: its flags (in the order --help lists them),
what argparse cannot refuse on its own, and the extraction's Options read from it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .formats import FORMATS, LOSS_MASKS
from .layers import choices, yaml_max_length
from .model import experts_budget
from .identity import ModelShape
from .reference import EVERY, MIN_ROWS
from .rows import Options
from .text import parse_bytes


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


def make_options(args: argparse.Namespace, shape: ModelShape, pad: int, config: Any = None) -> Options:
    """The extraction's Options from the command line, with the model's longest position and the
    batch width's multiple (`pad`, chosen once the model is loaded). With the model's `config`, an
    MoE's batches hold enough tokens for each expert (model.experts_budget; a dense model's budget
    is the command line's)."""
    budget = args.max_tokens_per_batch if config is None else experts_budget(args.max_tokens_per_batch, config)
    return Options(budget, args.max_length, args.too_long,
                   args.writer_queue, args.writer_threads, args.sort_window,
                   pad_multiple=pad, loss_mask=args.loss_mask, format=args.format,
                   max_positions=shape.max_positions, dtype=args.dtype,
                   micro_batches=args.micro_batches, window=yaml_max_length(args.layers),
                   spill=tuple(args.spill))
