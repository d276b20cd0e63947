"""What a run's work *is*, so that two runs are never mixed into one output folder.

A model is its config.json and a cheap fingerprint of its weight files (name, size, and a hash of
their first and last MiB: same-shape models differ there). A dataset is its size, row count, a
hash of its first and last rows and one of all its bytes (an edit in place that keeps the rest
still shows). Where the files live and when they were touched is recorded
(`path`, `mtime`) but not compared: each host has its own copy. Standard library only (pyarrow
when the dataset is Parquet or Arrow; transformers' config classes for the model's shape where
it is installed).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from .datafiles import DatasetFilesError, dataset_files, jsonl_row_count
from .protocol import WorkIdentity

EDGE = 1 << 20                      # bytes hashed at each end of a weight file
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
INFO_KEYS = {"path", "mtime"}       # recorded, never compared
LATER_KEYS = {"content"}            # compared where both sides record them (older plans do not)


class IdentityError(Exception):
    """The model or dataset cannot be read well enough to say what it is."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    max_positions: int | None        # longest sequence the model takes (None: not declared)


# config.json names of the shape in architectures whose config class maps them (GPT-2 style), for
# a host without transformers; with it, its own config classes answer (attribute_map).
SHAPE_KEYS = {"hidden_size": ("hidden_size", "n_embd", "d_model"),
              "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
              "max_positions": ("max_position_embeddings", "n_positions", "max_sequence_length")}


def model_shape(model: str) -> ModelShape | None:
    """The text model's shape without loading weights. config.json as written where it declares
    the shape itself (most models: their config class reads the same values, and preflight need not
    import transformers and torch for them, about 2 s a host); otherwise through transformers' own
    config class (GPT-2's n_embd / n_layer / n_positions, a class's default for what the file leaves
    out); the raw file with the common aliases where transformers is absent."""
    if not os.path.isfile(os.path.join(model, "config.json")):
        return None
    top = model_config(model)
    text = top.get("text_config", top) if top is not None else None
    text = text if isinstance(text, dict) else None
    if top is not None and text is not None and _declares_its_shape(top, text):
        return _shape({name: text[keys[0]] for name, keys in SHAPE_KEYS.items()})
    cfg = _transformers_config(model)
    if cfg is not None:
        text_cfg = getattr(cfg, "text_config", None) or cfg
        values = {name: getattr(text_cfg, keys[0], None) for name, keys in SHAPE_KEYS.items()}
        if values["max_positions"] is None:
            values["max_positions"] = getattr(text_cfg, "n_positions", None)
        return _shape(values)
    if text is None:
        return None
    return _shape({name: next((text[k] for k in keys if text.get(k) is not None), None)
                   for name, keys in SHAPE_KEYS.items()})


def _declares_its_shape(top: dict, text: dict) -> bool:
    """All three under transformers' names, in the file's text_config or, for a causal LM with no
    sub-config at all, at the top (a multimodal class builds a default text model for a file that
    leaves its text_config out; a quantization_config is left to transformers too)."""
    if not all(text.get(keys[0]) is not None for keys in SHAPE_KEYS.values()):
        return False
    if isinstance(top.get("text_config"), dict):
        return True
    architectures = top.get("architectures")
    return (not any(k.endswith("_config") for k in top) and isinstance(architectures, list)
            and bool(architectures) and all(str(a).endswith("ForCausalLM") for a in architectures))


def model_config(model: str) -> dict | None:
    """The model folder's config.json as a dict, or None where it is missing or unreadable."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def _transformers_config(model: str) -> Any:
    """transformers' config object for `model`, or None (no transformers, an unknown model_type,
    a malformed file)."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return None
    try:
        return AutoConfig.from_pretrained(model)
    except Exception:
        return None


def _shape(values: dict) -> ModelShape | None:
    hidden, layers, positions = values["hidden_size"], values["num_layers"], values["max_positions"]
    if hidden is None or layers is None:
        return None
    try:
        return ModelShape(int(hidden), int(layers), int(positions) if positions else None)
    except (TypeError, ValueError):
        return None


def output_identity(plan, fmt: str, loss_mask: str, dtype: str = "bf16") -> dict:
    """What is written: the layers (a worker.layers.LayerPlan), the format, the loss mask, the
    stored dtype (bf16 and fp8 files never share an output folder)."""
    return {"layer_ids": list(plan.ids), "last_layer_norm": plan.last_layer_norm,
            "target_last": bool(getattr(plan, "target_last", False)), "format": fmt, "loss_mask": loss_mask,
            "dtype": dtype}


def upgraded(identity: dict | WorkIdentity) -> dict:
    """An identity recorded before a key existed, with the value that key had then: every output
    written before the stored dtype was chosen is bf16."""
    identity = _recorded(identity)
    if ("format" in identity or "layer_ids" in identity) and "dtype" not in identity:
        return {**identity, "dtype": "bf16"}
    return identity


def work_identity(model: str | None, data: str | None, output: dict) -> WorkIdentity:
    """The identity of a run's work: model, data and what is written (IdentityError if unreadable)."""
    out: dict = {}
    if model:
        out["model"] = model_identity(model)
    if data:
        out["data"] = dataset_identity(data)
    out.update(output)
    return WorkIdentity.from_dict(out)


def _recorded(identity: dict | WorkIdentity) -> dict:
    """An identity as the keys it records (a typed one without its unset parts)."""
    return identity.to_dict() if isinstance(identity, WorkIdentity) else identity


def output_mismatch(out_dir: str, identity: WorkIdentity) -> list[str]:
    """How `identity` differs from the work already in `out_dir` (its meta.json); [] if none is
    there or it agrees. Only what both record is compared (an older meta.json records less)."""
    try:
        with open(os.path.join(out_dir, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return []
    return meta_mismatch(meta, identity)


def meta_mismatch(meta: dict | None, identity: WorkIdentity) -> list[str]:
    """How `identity` differs from the work a meta.json describes (a folder's or a destination's)."""
    held = meta.get("identity") if isinstance(meta, dict) else None
    if not isinstance(held, dict):
        held = {k: meta[k] for k in ("layer_ids", "last_layer_norm", "format", "loss_mask")
                if isinstance(meta, dict) and k in meta}
    held, ours = upgraded(held), identity.to_dict()
    return differences({k: v for k, v in held.items() if k in ours},
                       {k: v for k, v in ours.items() if k in held})


def model_identity(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise IdentityError(f"{path}/config.json: {getattr(e, 'strerror', None) or e}") from None
    config.pop("_name_or_path", None)
    files = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if name.endswith(WEIGHT_SUFFIXES) and os.path.isfile(full):
            size = os.path.getsize(full)
            with open(full, "rb") as f:
                head = f.read(EDGE)
                f.seek(max(size - EDGE, 0))
                tail = f.read(EDGE)
            files.append(f"{name}:{size}:{_sha(head + tail)}")
    return {"config": _sha(json.dumps(config, sort_keys=True).encode()),
            "weights": _sha("\n".join(files).encode()) if files else "none (random weights)",
            "path": os.path.abspath(path)}


def dataset_identity(path: str) -> dict:
    """Rows, bytes and the first and last rows' hashes of a JSONL file, a Parquet file or a folder
    of Parquet / `save_to_disk` files."""
    try:
        if os.path.isfile(path) and not path.endswith(".parquet"):
            rows = jsonl_row_count(path)
            with open(path, "rb") as f:
                first = f.readline().strip()
            last = _last_line(path)
            size = os.path.getsize(path)
        else:
            rows, first, last, size = _arrow_identity(path)
        mtime = os.path.getmtime(path)
        content = content_hash(path)
    except OSError as e:
        raise IdentityError(f"{path}: {e.strerror or e}") from None
    except DatasetFilesError as e:
        raise IdentityError(str(e)) from None
    return {"rows": rows, "bytes": size, "first_row": _sha(first), "last_row": _sha(last),
            "content": content, "path": os.path.abspath(path), "mtime": round(mtime, 3)}


def content_hash(path: str) -> str:
    """A hash of every byte of the dataset's own files (a file, or a folder's declared files by
    name: worker.datafiles), streamed: an edit in place that keeps the size, row count and first
    and last rows still changes it, and nothing else in the folder (speculators' hidden_states/,
    our own output) ever does. A read of the dataset, cheap next to extracting it."""
    h = hashlib.sha256()
    for name in dataset_files(path):
        if path != name:
            h.update(os.path.relpath(name, path).encode() + b"\0")
        with open(name, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:16]


def _last_line(path: str) -> bytes:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        pos, tail = end, b""
        while pos > 0 and tail.strip().count(b"\n") < 1:
            pos = max(pos - 65536, 0)
            f.seek(pos)
            tail = f.read(end - pos)
    lines = [l for l in tail.split(b"\n") if l.strip()]
    return lines[-1].strip() if lines else b""


def _arrow_identity(path: str) -> tuple[int, bytes, bytes, int]:
    from .data import open_dataset          # pyarrow only here, where the dataset needs it
    ds = open_dataset(path)
    size = sum(os.path.getsize(f) for f in dataset_files(path))
    n = ds.num_rows
    edge = [json.dumps(row, sort_keys=True, default=str).encode()
            for _, row in list(ds.rows(0, min(n, 1))) + list(ds.rows(max(n - 1, 0), n))]
    return n, edge[0] if edge else b"", edge[-1] if edge else b"", size


def differences(old: dict | WorkIdentity, new: dict | WorkIdentity, prefix: str = "") -> list[str]:
    """'key: old -> new' for every compared value that differs (nested dicts flattened)."""
    old, new = _recorded(old), _recorded(new)
    out = []
    for key in sorted(set(old) | set(new)):
        if key in INFO_KEYS or (key in LATER_KEYS and (key not in old or key not in new)):
            continue
        a, b = old.get(key), new.get(key)
        name = f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            inner = differences(a, b, name + ".")
            if inner and a.get("path") != b.get("path"):      # say which files, where it helps
                inner.insert(0, f"{name}.path: {a.get('path')} -> {b.get('path')}")
            out += inner
        elif a != b:
            out.append(f"{name}: {_show(a)} -> {_show(b)}")
    return out


def _show(v) -> str:
    return "absent" if v is None else json.dumps(v) if not isinstance(v, str) else v
