"""What a shard of `python -m worker.extract` settles before it loads its model: the devices it
runs on, its dataset and rows, the model's shape and the layers to capture, its work's identity
against the run's plan and the output folder (refused before any file is touched), the output's
folders claimed, and the tokenizer raw chats need.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
from typing import IO, Any, Callable

import torch

from . import protocol
from .data import DataError, Dataset, open_dataset, shard_range
from .events import EventLog
from .formats import Layout
from .identity import (IdentityError, ModelShape, differences, model_shape, output_identity, output_mismatch,
                       upgraded, work_identity)
from .layers import LayerPlan, resolve_layers
from .model import ModelError
from .shard_exit import ForeignOutput, NotRetryable
from .writer import claim_output


def shard_devices(args: argparse.Namespace) -> list[str]:
    """The devices the model's layers are spread over: --devices; else cuda:0..k-1 for
    --gpus-per-shard k on a GPU; else the one device (--device, or cuda:0 when there is one)."""
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    return args.devices.split(",") if args.devices else \
        [f"cuda:{i}" for i in range(args.gpus_per_shard)] if device.type == "cuda" and args.gpus_per_shard > 1 \
        else [str(device)]


def check_gpus_visible(device: torch.device, devices: list[str]) -> None:
    """A model spread over more GPUs than this process sees is the user's error, said before the load."""
    if device.type == "cuda" and len(devices) > torch.cuda.device_count():
        raise ModelError(f"--gpus-per-shard {len(devices)}: only {torch.cuda.device_count()} GPU(s) "
                         f"visible (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '')})")


def open_shard(args: argparse.Namespace, log: EventLog, device: torch.device) -> tuple[Dataset, int, int]:
    """The dataset and this shard's rows [start, stop), announced by the `started` event."""
    dataset = open_dataset(args.data)
    if dataset.num_rows == 0:
        raise DataError(f"{args.data}: empty (0 rows)")
    start, stop = shard_range(dataset.num_rows, args.num_shards, args.shard_index)
    log.emit(protocol.Started(pid=os.getpid(), host=socket.gethostname(), device=str(device),
                              shard=args.shard_index, num_shards=args.num_shards, start=start,
                              stop=stop, total=stop - start, num_rows=dataset.num_rows))
    return dataset, start, stop


def resolve_work(args: argparse.Namespace) -> tuple[ModelShape, LayerPlan, Layout]:
    """The model's shape (from its config.json), the layers to capture and the files' layout."""
    shape = model_shape(args.model)
    if shape is None:
        raise ModelError(f"{args.model}: " + ("no config.json with hidden_size and num_hidden_layers"
                                               if os.path.isdir(args.model) else "model folder not found"))
    plan = resolve_layers(args.layers or args.format, shape.num_layers,
                          args.last_layer_norm, args.target_last_hidden_states)
    return shape, plan, Layout(args.format, plan, args.dtype)


def claim_folders(args: argparse.Namespace) -> IO[Any]:
    """The output folder (and every --spill folder) claimed for the run's plan; the output's lock
    is returned and must be kept open for the process's life."""
    planned = read_plan_file(args.plan) if args.plan else {}
    for folder in args.spill:                  # another run's spill folder is refused like its output
        claim_output(folder, planned.get("run"), planned.get("created"), args.shard_index)
    return claim_output(args.out, planned.get("run"), planned.get("created"), args.shard_index)


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
    """The run's plan.json as fleet wrote it; one that cannot be read is the user's error."""
    try:
        with open(path) as f:
            plan = json.load(f)
        if not isinstance(plan, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read the run's plan: {e}") from None
    return plan


def chat_tokenizer(model: str) -> Callable[[], Any]:
    """The model's tokenizer, loaded on first use (only raw chat rows need it), once."""
    @functools.cache
    def tokenizer() -> Any:
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError) as e:
            raise ModelError(f"{model}: raw chat rows need the model's tokenizer, which "
                             f"did not load: {str(e).splitlines()[0]}") from None
    return tokenizer
