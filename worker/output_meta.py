"""The output's meta.json: what its files hold (format, where the trainer reads, layers, loss mask,
dtype) and what made them (model, data, versions). The trainers, verify and the next launch's
identity check read it.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from typing import Any

import torch

from . import __version__, protocol
from .formats import LOSS_MASK_CONVENTIONS, Layout, trainer_setting
from .layers import yaml_max_length
from .writer import write_json_atomic


def write_run_meta(args: argparse.Namespace, config: Any, dtype: torch.dtype, layout: Layout, num_rows: int,
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
