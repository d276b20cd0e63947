"""`python -m worker.verify --out DIR`: check a host's output folder; one JSON object on stdout.

Every manifest entry's file exists, opens, has the declared shapes and metadata, and holds finite
values; every index is recorded once. The supervisor merges hosts' reports and checks that every
global index 0..N-1 is present exactly once across the fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from . import protocol


def to_ranges(indices) -> list[list[int]]:
    """Sorted indices -> [[start, stop), ...]."""
    ranges: list[list[int]] = []
    for i in sorted(indices):
        if ranges and ranges[-1][1] == i:
            ranges[-1][1] = i + 1
        else:
            ranges.append([i, i + 1])
    return ranges


def check_file(out: str, rec: dict, layers: int | None, hidden: int | None) -> str | None:
    import torch
    from safetensors import safe_open

    index, T = rec["index"], rec.get("tokens")
    path = os.path.join(out, protocol.sample_file_name(index))
    try:
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
            hs = f.get_tensor("hidden_states")
            ids = f.get_tensor("token_ids")
            mask = f.get_tensor("loss_mask")
    except FileNotFoundError:
        return f"sample {index}: {path} missing"
    except Exception as e:
        return f"sample {index}: {path} unreadable: {type(e).__name__}: {e}"
    if hs.dtype != torch.bfloat16:
        return f"sample {index}: hidden_states dtype {hs.dtype}, expected bfloat16"
    expect = (T, layers, hidden)
    if hs.dim() != 3 or any(e is not None and e != s for e, s in zip(expect, hs.shape)):
        return f"sample {index}: hidden_states shape {tuple(hs.shape)}, expected {expect}"
    if ids.shape != (hs.shape[0],) or mask.shape != (hs.shape[0],):
        return f"sample {index}: token_ids/loss_mask length differs from hidden_states"
    if meta.get("sample_index") != str(index):
        return f"sample {index}: metadata sample_index is {meta.get('sample_index')!r}"
    if not bool(torch.isfinite(hs).all()):
        return f"sample {index}: non-finite values"
    return None


def verify(out: str, deep: bool = True, threads: int = 8) -> dict:
    meta_path = os.path.join(out, protocol.META_FILE)
    try:
        meta = json.load(open(meta_path))
    except (OSError, ValueError):
        meta = {}
    problems: list[str] = []
    seen: dict[int, dict] = {}
    folder = os.path.join(out, protocol.MANIFEST_DIR)
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        for rec in protocol.iter_jsonl(os.path.join(folder, name)):
            i = rec.get("index")
            if not isinstance(i, int):
                continue
            if i in seen:
                problems.append(f"sample {i}: recorded twice in the manifests")
                continue
            seen[i] = rec
    written = [r for r in seen.values() if "skipped" not in r]
    skipped = {i: r["skipped"] for i, r in seen.items() if "skipped" in r}
    layers = len(meta["layer_ids"]) if "layer_ids" in meta else None
    if deep and written:
        with ThreadPoolExecutor(threads) as pool:
            for problem in pool.map(lambda r: check_file(out, r, layers, meta.get("hidden_size")), written):
                if problem:
                    problems.append(problem)
    on_disk = set()
    if os.path.isdir(out):
        for name in os.listdir(out):
            if name.startswith(protocol.SAMPLE_PREFIX) and name.endswith(protocol.SAMPLE_SUFFIX):
                try:
                    on_disk.add(int(name[len(protocol.SAMPLE_PREFIX):-len(protocol.SAMPLE_SUFFIX)]))
                except ValueError:
                    problems.append(f"{name}: unexpected file name")
    unrecorded = on_disk - {r["index"] for r in written}
    return {"num_samples": meta.get("num_samples"), "written": to_ranges(r["index"] for r in written),
            "skipped": {str(i): why for i, why in sorted(skipped.items())},
            "unrecorded_files": len(unrecorded), "problems": problems, "checked": len(written)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.verify")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shallow", action="store_true", help="manifests only; do not open the files")
    args = ap.parse_args(argv)
    print(json.dumps(verify(args.out, deep=not args.shallow)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
