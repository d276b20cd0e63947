"""`python -m worker.preflight`: can this host run its shards? One JSON object on stdout.

Checks the Python version, torch/transformers/safetensors (built-in job only), GPUs against the
ones asked for, the model and data paths, the layers and format (through the worker's own resolver),
and free disk at the output against the estimated output size (tokens x layers x hidden x 2 bytes).
Standard library only, except that it imports torch when the built-in job needs it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from .formats import FormatError, check_plan
from .gpu import GpuReader
from .layers import LayerError, resolve_layers
from .probe import disk_space

MIN_PYTHON = (3, 9)


def model_shape(model: str) -> tuple[int, int] | None:
    """(hidden_size, num_hidden_layers) from config.json, text_config first."""
    try:
        cfg = json.load(open(os.path.join(model, "config.json")))
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    if "hidden_size" in cfg and "num_hidden_layers" in cfg:
        return int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    return None


def estimate_tokens(data: str, sample_rows: int = 2000) -> int | None:
    """Mean tokens of the first rows x row count (raw chats: ~3.5 characters a token). JSONL only."""
    if not data.endswith((".jsonl", ".json")) or not os.path.isfile(data):
        return None
    rows, tokens = 0, 0
    with open(data, "rb") as f:
        for n, line in enumerate(f):
            if n < sample_rows:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("input_ids"), list):
                    tokens += len(row["input_ids"])
                else:
                    tokens += int(len(line) / 3.5)
            rows = n + 1
    return int(tokens / min(rows, sample_rows) * rows) if rows else 0


def existing_output_bytes(output: str) -> int:
    folder = os.path.join(output, "manifest")
    total = 0
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            try:
                for line in open(os.path.join(folder, name)):
                    total += json.loads(line).get("bytes", 0)
            except (OSError, ValueError):
                pass
    return total


def run(args: argparse.Namespace) -> dict:
    checks: list[dict] = []

    def check(level: str, message: str) -> None:
        checks.append({"level": level, "message": message})

    report: dict = {"python": ".".join(map(str, sys.version_info[:3])), "checks": checks}
    if sys.version_info < MIN_PYTHON:
        check("error", f"python {report['python']} is older than {'.'.join(map(str, MIN_PYTHON))}")
    reader = GpuReader()
    gpus = reader.read()
    report["telemetry"] = reader.source
    count = len(gpus)
    if args.builtin:
        missing = [m for m in ("torch", "transformers", "safetensors", "numpy")
                   if importlib.util.find_spec(m) is None]
        if missing:
            check("error", f"missing Python packages for the worker: {', '.join(missing)} "
                           f"(pip install 'fleet[worker]' on the host)")
        else:
            import torch
            report["torch"] = torch.__version__
            report["cuda_devices"] = torch.cuda.device_count()
            count = max(count, report["cuda_devices"])
    report["gpu_count"] = count
    if args.gpus == "all":
        resolved = list(range(count))
        if not resolved:
            if args.device == "cpu":
                resolved = [0]
                check("warning", "no GPUs: gpus = \"all\" runs one shard on the CPU")
            else:
                check("error", "no GPUs found for gpus = \"all\"; list gpus explicitly or set device = \"cpu\"")
    else:
        resolved = [int(x) for x in args.gpus.split(",")]
        if args.device != "cpu":
            bad = [g for g in resolved if g >= count]
            if bad:
                check("error" if args.device == "cuda" else "warning",
                      f"GPU index {bad[0]} out of range: host has {count} GPU(s)"
                      + ("" if args.device == "cuda" else "; shards will run on the CPU"))
    report["gpus"] = resolved
    for label, path in (("model", args.model), ("data", args.data)):
        if path and not os.path.exists(path):
            check("error", f"{label} path {path} does not exist")
    if args.builtin and args.model and os.path.isdir(args.model) and not args.demo:
        if model_shape(args.model) is None:
            check("error", f"{args.model}/config.json is missing or has no hidden_size/num_hidden_layers")
    shape = model_shape(args.model) if args.model else None
    layer_count = None
    if args.builtin and shape:
        try:          # the worker's own resolver: the same ids, the same refusals, before launch
            plan = resolve_layers(args.layers or args.format, shape[1], None,
                                  args.target_last_hidden_states)
            check_plan(args.format, plan)
            layer_count = len(plan.ids)
        except (LayerError, FormatError) as e:
            check("error", str(e))
    if args.output:
        space = disk_space(args.output)
        free = report["free_bytes"] = space.free
        if not os.access(space.probe, os.W_OK):
            check("error", f"output {args.output}: {space.probe} is not writable")
        tokens = estimate_tokens(args.data) if args.data else None
        if shape and tokens is not None and layer_count:
            need = tokens * layer_count * shape[0] * 2 - existing_output_bytes(args.output)
            report["estimated_bytes"] = max(need, 0)
            if need > free:
                check("error", f"output {args.output}: needs about {need / 1e9:.1f} GB, "
                               f"{free / 1e9:.1f} GB free")
            elif need > 0.8 * free:
                check("warning", f"output {args.output}: needs about {need / 1e9:.1f} GB of "
                                 f"{free / 1e9:.1f} GB free")
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m worker.preflight")
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--output", default=None)
    ap.add_argument("--gpus", default="all")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--layers", default=None, help="as the worker's --layers (default: --format)")
    ap.add_argument("--format", default="speculators")
    ap.add_argument("--target-last-hidden-states", action="store_true")
    ap.add_argument("--loss-mask", default="assistant", help="accepted as the worker takes it")
    ap.add_argument("--builtin", action="store_true", help="the built-in extraction worker runs here")
    ap.add_argument("--demo", action="store_true", help="model and data are made on first use")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
