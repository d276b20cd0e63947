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

from .formats import FormatError, check_dtype, check_plan, payload_bytes
from .gpu import GpuReader
from .identity import (IdentityError, model_shape, output_identity, output_mismatch,
                       work_identity)
from .layers import LayerError, resolve_layers
from .plan import read_plan
from .probe import disk_space

MIN_PYTHON = (3, 9)


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


def dataset_problem(path: str, rows: int | None, sample: int = 100) -> str | None:
    """Nothing counts as done that did nothing: an empty dataset, a JSON array where JSON lines are
    read, or first rows none of which the worker can use are refused before any launch."""
    if rows == 0:
        return f"data {path}: empty (0 rows)"
    with open(path, "rb") as f:
        head = f.read(1 << 16).lstrip()
        f.seek(0)
        lines = [l for _, l in zip(range(sample), f)]
    if head.startswith(b"["):
        return (f"data {path}: a JSON array, not JSON lines (one object per line); convert it, "
                f"e.g. jq -c '.[]' {path} > {path.rsplit('.', 1)[0]}.jsonl")
    reasons = [row_problem(l) for l in lines]
    if reasons and all(reasons):
        return f"data {path}: none of the first {len(reasons)} rows is usable: row 0: {reasons[0]}"
    return None


def row_problem(line: bytes) -> str | None:
    try:
        row = json.loads(line)
    except ValueError as e:
        return f"not valid JSON: {e}"
    if not isinstance(row, dict):
        return "row is not an object"
    ids = row.get("input_ids")
    if ids is not None:
        ok = isinstance(ids, list) and ids and all(isinstance(x, int) and not isinstance(x, bool) for x in ids)
        return None if ok else "input_ids is not a non-empty list of integers"
    turns = row.get("messages", row.get("conversations"))
    if isinstance(turns, list) and turns:
        return None
    return "row has none of input_ids, conversations, messages"


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
    if args.run_dir:
        report["plan"] = read_plan(args.run_dir)
    if args.builtin and args.model and os.path.isdir(args.model) and not args.demo:
        if model_shape(args.model) is None:
            check("error", f"{args.model}/config.json is missing or has no hidden_size/num_hidden_layers")
    shape = model_shape(args.model) if args.model else None
    layers = None
    if args.builtin and shape:
        try:          # the worker's own resolver: the same ids, the same refusals, before launch
            layers = resolve_layers(args.layers or args.format, shape.num_layers, None,
                                    args.target_last_hidden_states)
            check_plan(args.format, layers)
            check_dtype(args.format, args.dtype)
        except (LayerError, FormatError) as e:
            check("error", str(e))
            layers = None
    try:
        output = output_identity(layers, args.format, args.loss_mask, args.dtype) if layers else {}
        model = args.model if args.builtin and args.model and os.path.isdir(args.model) else None
        data = args.data if args.data and os.path.exists(args.data) else None
        report["identity"] = identity = work_identity(model, data, output)
    except IdentityError as e:
        check("error", str(e))
        report["identity"] = identity = {}
    if args.builtin and args.data and os.path.isfile(args.data):
        problem = dataset_problem(args.data, identity.get("data", {}).get("rows"))
        if problem:
            check("error", problem)
    if args.output:
        for part in os.path.abspath(args.output).split(os.sep):
            if len(part.encode()) > 255:
                check("error", f"output {args.output}: a folder name is {len(part.encode())} bytes long; "
                               f"file systems allow 255")
        diffs = output_mismatch(args.output, identity) if identity else []
        if diffs:
            check("error", f"output {args.output} holds another run's work (its meta.json): "
                           + "; ".join(diffs) + " — use another output folder")
    if args.output:
        space = disk_space(args.output)
        free = report["free_bytes"] = space.free
        if not os.access(space.probe, os.W_OK):
            check("error", f"output {args.output}: {space.probe} is not writable")
        tokens = estimate_tokens(args.data) if args.data else None
        if shape and tokens is not None and layers:
            need = payload_bytes(tokens, len(layers.ids), shape.hidden_size, args.dtype) \
                - existing_output_bytes(args.output)
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
    ap.add_argument("--dtype", default="bf16", help="hidden states as stored: bf16 | fp8")
    ap.add_argument("--target-last-hidden-states", action="store_true")
    ap.add_argument("--loss-mask", default="assistant", help="accepted as the worker takes it")
    ap.add_argument("--run-dir", default=None, help="the run's folder: its plan.json is reported")
    ap.add_argument("--builtin", action="store_true", help="the built-in extraction worker runs here")
    ap.add_argument("--demo", action="store_true", help="model and data are made on first use")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    print(json.dumps(run(parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
