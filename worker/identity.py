"""What a run's work *is*, so that two runs are never mixed into one output folder.

A model is its config.json and a cheap fingerprint of its weight files (name, size, and a hash of
their first and last MiB: same-shape models differ there). A dataset is its size, row count and
a hash of its first and last rows. Where the files live and when they were touched is recorded
(`path`, `mtime`) but not compared: each host has its own copy. Standard library only (pyarrow
when the dataset is Parquet or Arrow).
"""

from __future__ import annotations

import hashlib
import json
import os

EDGE = 1 << 20                      # bytes hashed at each end of a weight file
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
INFO_KEYS = {"path", "mtime"}       # recorded, never compared


class IdentityError(Exception):
    """The model or dataset cannot be read well enough to say what it is."""


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def jsonl_row_count(path: str) -> int:
    """Lines of a JSON-lines file (a last line without a newline counts): the worker's row count."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (0 if last == b"\n" else 1)


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
    except OSError as e:
        raise IdentityError(f"{path}: {e.strerror or e}") from None
    return {"rows": rows, "bytes": size, "first_row": _sha(first), "last_row": _sha(last),
            "path": os.path.abspath(path), "mtime": round(mtime, 3)}


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
    files = [path] if os.path.isfile(path) else [os.path.join(path, n) for n in os.listdir(path)]
    size = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    n = ds.num_rows
    edge = [json.dumps(row, sort_keys=True, default=str).encode()
            for _, row in list(ds.rows(0, min(n, 1))) + list(ds.rows(max(n - 1, 0), n))]
    return n, edge[0] if edge else b"", edge[-1] if edge else b"", size


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """'key: old -> new' for every compared value that differs (nested dicts flattened)."""
    out = []
    for key in sorted(set(old) | set(new)):
        if key in INFO_KEYS:
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
