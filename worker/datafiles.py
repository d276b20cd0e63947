"""Which files a dataset is made of, and how many rows a JSON-lines file has (standard library only).

A dataset folder is its *declared* files and nothing else: a `save_to_disk` folder is its
`state.json`, `dataset_info.json` and the data files `state.json` lists; a Parquet folder is its
top-level `*.parquet` files. speculators keeps the hidden states inside the dataset folder
(`<data>/hidden_states`), so anything beside those files — our own output among it — is never
read as the data: not by the rows (worker.data), not by the identity (worker.identity).
"""

from __future__ import annotations

import json
import os


class DatasetFilesError(ValueError):
    """A folder whose declared files cannot be read (a broken state.json, no data files)."""


def dataset_files(path: str) -> list[str]:
    """Every file the dataset at `path` is, in reading order (a file: itself)."""
    bookkeeping, data = _declared(path)
    return bookkeeping + data


def data_files(path: str) -> list[str]:
    """The files holding the rows: dataset_files without save_to_disk's state and info files."""
    return _declared(path)[1]


def _declared(path: str) -> tuple[list[str], list[str]]:
    if not os.path.isdir(path):
        return [], [path]
    state = os.path.join(path, "state.json")
    if os.path.exists(state):                                   # datasets.save_to_disk
        try:
            with open(state) as f:
                entries = json.load(f).get("_data_files", [])
            data = [os.path.join(path, e["filename"]) for e in entries]
        except (ValueError, AttributeError, TypeError, KeyError) as e:
            raise DatasetFilesError(f"{state}: not a save_to_disk state file ({e})") from None
        if not data:
            raise DatasetFilesError(f"{path}: state.json lists no data files")
        info = os.path.join(path, "dataset_info.json")
        return [state] + ([info] if os.path.isfile(info) else []), data
    parquet = sorted(n for n in os.listdir(path) if n.endswith(".parquet"))
    if not parquet:
        raise DatasetFilesError(f"{path}: folder holds neither a save_to_disk dataset nor .parquet files")
    return [], [os.path.join(path, n) for n in parquet]


def jsonl_row_count(path: str) -> int:
    """Lines of a JSON-lines file (a last line without a newline counts): the worker's row count."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (0 if last == b"\n" else 1)
