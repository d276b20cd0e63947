"""Presets for worker.tuning from a host's Triton autotune cache: each kernel's key and its
fastest config, as the GPU timed them (`<root>/cache` of a host that tuned, e.g. after a first
launch). Key entries that hold a size (worker.tuning.SIZE_POSITIONS) become null.

    python bench/tuning_presets.py /tmp/fleet-gpu/fleet/cache --json presets.json
    FLEET_TUNING_PRESETS=presets.json fleet up ...        # a host of that GPU then times nothing

The printed table is what goes into worker.tuning.PRESETS for that GPU.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from worker.tuning import SIZE_POSITIONS  # noqa: E402


def first(t) -> float:
    return t[0] if isinstance(t, list) else t


def presets(cache: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for path in sorted(glob.glob(os.path.join(cache, "**", "*.autotune.json"), recursive=True)):
        kernel = os.path.basename(path).removesuffix(".autotune.json")
        with open(path) as f:
            d = json.load(f)
        timings = d.get("configs_timings") or []
        if len(timings) < 2:                         # one candidate: nothing was chosen
            continue
        raw, _ = min(timings, key=lambda ct: first(ct[1]))     # Triton writes Config.__dict__
        config = {**raw.get("kwargs", {}), "num_warps": raw.get("num_warps"), "num_stages": raw.get("num_stages")}
        key = [None if i in SIZE_POSITIONS.get(kernel, ()) else k for i, k in enumerate(d["key"])]
        entry = [key, config]
        if entry not in out.setdefault(kernel, []):
            out[kernel].append(entry)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cache")
    p.add_argument("--gpu", default=None, help="the GPU's name as torch gives it (default: this machine's)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    gpu = args.gpu
    if gpu is None:
        import torch
        gpu = torch.cuda.get_device_name()
    table = {gpu: presets(args.cache)}
    text = json.dumps(table, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
