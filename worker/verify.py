"""`python -m worker.verify --out DIR`: check a host's output folder; one JSON object on stdout.

Every manifest entry's file exists where meta.json's format puts it, opens, has the declared keys,
shapes and metadata, and holds finite values; every index is recorded once. The supervisor merges hosts' reports and checks that every
global index 0..N-1 is present exactly once across the fleet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from . import protocol
from .formats import FormatError, Layout
from .layers import LayerPlan


def to_ranges(indices) -> list[list[int]]:
    """Sorted indices -> [[start, stop), ...]."""
    ranges: list[list[int]] = []
    for i in sorted(indices):
        if ranges and ranges[-1][1] == i:
            ranges[-1][1] = i + 1
        else:
            ranges.append([i, i + 1])
    return ranges


def layout_of(meta: dict) -> Layout:
    """The layout meta.json describes (runs from before formats existed are speculators files)."""
    ids = tuple(meta.get("layer_ids", ()))
    L = meta.get("num_layers", max(ids, default=0))
    plan = LayerPlan(ids, meta.get("last_layer_norm", "none"), L,
                     bool(meta.get("target_last_hidden_states", False)))
    try:
        return Layout(meta.get("format", "speculators"), plan)
    except FormatError:                    # an unreadable meta.json: check what can be checked
        return Layout("speculators", plan)


def check_file(layout: Layout, out: str, rec: dict, hidden: int | None) -> str | None:
    index = rec["index"]
    path = layout.path(out, index)
    try:
        tensors, meta = layout.load(path)
    except FileNotFoundError:
        return f"sample {index}: {path} missing"
    except Exception as e:
        return f"sample {index}: {path} unreadable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    problem = layout.check(tensors, rec.get("tokens"), hidden)
    if problem:
        return f"sample {index}: {path}: {problem}"
    if layout.format == "speculators" and meta.get("sample_index") != str(index):
        return f"sample {index}: metadata sample_index is {meta.get('sample_index')!r}"
    return None


def verify(out: str, deep: bool = True, threads: int = 8) -> dict:
    meta_path = os.path.join(out, protocol.META_FILE)
    try:
        meta = json.load(open(meta_path))
    except (OSError, ValueError):
        meta = {}
    layout = layout_of(meta)
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
    if deep and written:
        with ThreadPoolExecutor(threads) as pool:
            for problem in pool.map(lambda r: check_file(layout, out, r, meta.get("hidden_size")),
                                    written):
                if problem:
                    problems.append(problem)
    unrecorded = set(layout.scan(out)) - {r["index"] for r in written}
    return {"num_samples": meta.get("num_samples"), "format": layout.format,
            "written": to_ranges(r["index"] for r in written),
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
