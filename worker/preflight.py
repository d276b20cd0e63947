"""`python -m worker.preflight`: can this host run its shards? One JSON object on stdout.

Checks the Python version, torch/transformers/safetensors (built-in job only), GPUs against the
ones asked for, the model and data paths, the layers, format and dtype (through the worker's own
resolver), and measures free disk at the output. For the built-in worker it projects the output's
size (`footprint`): every row's tokens x (layers x hidden x bytes per element, + a scale per layer
for fp8, + ids and mask) + each file's fixed bytes, from the dataset's real lengths where that is
cheap (input_ids of JSONL rows, a saved dataset's seq_len or input_ids lengths) and an estimate
that says so where it is not (raw chats), in buckets of rows with what the output already holds
taken off: fleet sums the buckets of each host's shards and compares them with its free space.
Standard library only, except that it imports torch when the built-in job needs it (and pyarrow for
a Parquet / saved dataset).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import time

from . import protocol
from .files import OWNER_PATH, folder_owner, manifest_records, relation, run_outputs_near
from .formats import FormatError, Layout, check_dtype, check_plan
from .gpu import GpuReader
from .identity import (IdentityError, model_config, model_shape, output_identity, output_mismatch,
                       work_identity)
from .layers import LayerError, LayerPlan, resolve_layers
from .plan import read_plan
from .probe import disk_space, write_rate
from .text import bytes_text

MIN_PYTHON = (3, 9)
# Where a GPU driver shows itself (NVIDIA's; ROCm's, which torch.cuda also speaks): a host with none
# has no CUDA device to count.
GPU_DRIVER = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/kfd")


CHARS_PER_TOKEN = 3.5                # raw chats: the estimate where rows are not tokenized
BUCKETS = 1024                       # row buckets of the footprint (fleet sums those of each host)
SCAN_BUDGET_S = 30.0                 # reading JSONL lengths past this is extrapolated (and says so)


def _jsonl_ids_length(line: bytes) -> int | None:
    """len(input_ids) of a JSONL row without parsing it (counting commas), None if it has none."""
    key = line.find(b'"input_ids"')
    if key < 0:
        return None
    start = line.find(b"[", key)
    if start < 0 or line[key + 11:start].strip() != b":":
        return None
    stop = line.find(b"]", start)
    if stop < 0:
        return None
    body = line[start + 1:stop]
    return body.count(b",") + 1 if body.strip() else 0


def jsonl_lengths(path: str, budget_s: float = SCAN_BUDGET_S) -> tuple[list[float], str, bool]:
    """Tokens of every row, the basis of that figure, and whether it is exact."""
    lengths: list[float] = []
    chats, t0, cut = 0, time.monotonic(), False
    with open(path, "rb") as f:
        for n, line in enumerate(f):
            if n % 4096 == 0 and time.monotonic() - t0 > budget_s:
                cut = True
                break
            ids = _jsonl_ids_length(line)
            if ids is None:
                chats += 1
                lengths.append(len(line.strip()) / CHARS_PER_TOKEN)
            else:
                lengths.append(ids)
    if cut:
        from .datafiles import jsonl_row_count
        rows = jsonl_row_count(path)
        mean = sum(lengths) / max(len(lengths), 1)
        return (lengths + [mean] * (rows - len(lengths)),
                f"estimate: lengths of the first {len(lengths):,} of {rows:,} rows, their mean for the rest", False)
    if chats:
        return lengths, (f"estimate: {chats:,} of {len(lengths):,} rows are raw chats, counted at "
                         f"~{CHARS_PER_TOKEN} characters a token"), False
    return lengths, f"input_ids lengths of all {len(lengths):,} rows", True


def arrow_lengths(path: str) -> tuple[list[float], str, bool]:
    from .data import _arrow_table
    table = _arrow_table(path)
    rows = table.num_rows
    if "seq_len" in table.column_names:
        return [int(x or 0) for x in table.column("seq_len").to_pylist()], f"seq_len of all {rows:,} rows", True
    if "input_ids" in table.column_names:
        import pyarrow.compute as pc
        lengths = pc.list_value_length(table.column("input_ids")).to_pylist()
        return [int(x or 0) for x in lengths], f"input_ids lengths of all {rows:,} rows", True
    head = table.slice(0, min(rows, 1000)).to_pylist()
    mean = sum(len(json.dumps(r, default=str)) for r in head) / max(len(head), 1) / CHARS_PER_TOKEN
    return [mean] * rows, (f"estimate: raw chats, the first {len(head):,} rows' characters at "
                           f"~{CHARS_PER_TOKEN} a token"), False


def finished_rows(output: str) -> tuple[set[int], int]:
    """Indices the output's manifests record (written or skipped) and the bytes written."""
    done: set[int] = set()
    written = 0
    for rec in manifest_records(output):
        done.add(rec["index"])
        written += rec.get("bytes", 0) if isinstance(rec.get("bytes"), int) else 0
    return done, written


def footprint(data: str, output: str, layout: Layout, hidden_size: int, max_length: int | None = None,
              too_long: str = "skip", max_positions: int | None = None) -> protocol.Footprint:
    """The output's projected size for the whole run, and what is still to write, by row bucket."""
    if os.path.isfile(data) and not data.endswith(".parquet"):
        lengths, basis, exact = jsonl_lengths(data)
    else:
        lengths, basis, exact = arrow_lengths(data)
    per_token, per_file = layout.bytes_per_token(hidden_size), layout.bytes_per_file()
    done, written = finished_rows(output)
    rows = len(lengths)
    k = min(rows, BUCKETS)
    edges = [j * rows // k for j in range(k + 1)] if k else [0]
    remaining = [0.0] * k
    tokens = total = 0.0
    for i, length in enumerate(lengths):
        if max_length and length > max_length:
            length = max_length if too_long == "truncate" else 0       # skipped: no file
        if max_positions and length > max_positions:
            length = 0
        row_bytes = length * per_token + per_file if length else 0
        tokens += length
        total += row_bytes
        if i not in done:
            remaining[i * k // rows] += row_bytes
    fp8 = (Layout(layout.format, layout.plan, "fp8").bytes_per_token(hidden_size)    # what dtype = "fp8"
           if layout.dtype == "bf16" and layout.format == "speculators" else None)   # would take
    return protocol.Footprint(rows=rows, tokens=round(tokens), exact=exact, basis=basis, dtype=layout.dtype,
                              layers=len(layout.plan.ids), hidden_size=hidden_size, bytes_per_token=per_token,
                              bytes_per_file=per_file, total_bytes=round(total), written_bytes=written,
                              edges=edges, remaining=[round(b) for b in remaining], bytes_per_token_fp8=fp8)


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


def weight_files_problem(model: str) -> str | None:
    """A weight file the index names that is absent, or a safetensors file shorter than its own
    header declares (a copy cut short), named before any launch: loading would fail on every try,
    or worse, fill what is missing at random."""
    for name in sorted(os.listdir(model)):
        if not name.endswith(".index.json"):
            continue
        try:
            with open(os.path.join(model, name)) as f:
                index = json.load(f)
            files = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{model}/{name}: unreadable weight index ({type(e).__name__}: {e})"
        absent = [f for f in files if not os.path.isfile(os.path.join(model, f))]
        if absent:
            return (f"{model}/{name} names {len(absent)} weight file(s) that are not there: "
                    f"{', '.join(absent[:5])}{' ...' if len(absent) > 5 else ''}")
    for name in sorted(os.listdir(model)):
        if name.endswith(".safetensors"):
            if problem := safetensors_problem(os.path.join(model, name)):
                return problem
    return None


def safetensors_problem(path: str) -> str | None:
    """A safetensors file is 8 bytes of header length, the JSON header, then the tensors, whose
    byte ranges the header gives: the file must hold all of them."""
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n <= 0 or 8 + n > size:
                return f"{path}: truncated ({size:,} bytes; its header alone declares {8 + n:,})"
            header = json.loads(f.read(n))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{path}: not a readable safetensors file ({type(e).__name__}: {e})"
    if 8 + n + end > size:
        return f"{path}: truncated ({size:,} bytes; its header declares {8 + n + end:,})"
    return None


ACTIVATION_BYTES_PER_TOKEN_PER_H = 48   # a batch's live activations, per token, in units of H bytes:
                                        # measured 2.66 GiB for 16K tokens at H=4096 (bf16), ~42


def fit_problem(model: str, shape, gpus: list[protocol.GpuStat], k: int, budget: int, layers: int) -> str | None:
    """Do the weights and one batch fit the k GPUs a shard gets? Weights from the weight files
    (none: random weights, not checked); GPU memory from telemetry (none: not checked)."""
    weights = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                  if f.endswith((".safetensors", ".bin")))
    totals = [g.mem_total for g in gpus if g.mem_total]
    if not weights or len(totals) < k:
        return None
    activations = budget * shape.hidden_size * ACTIVATION_BYTES_PER_TOKEN_PER_H
    captured = budget * layers * shape.hidden_size * 2 * 2           # the stacked states, and their copy
    need = weights / k + activations + captured
    have = 0.92 * min(totals)                                        # CUDA context, fragmentation
    if need <= have:
        return None
    fits = math.ceil(weights / max(have - activations - captured, 1))
    return (f"{bytes_text(weights)} of weights over {k} GPU(s) plus one {budget}-token batch "
            f"(~{bytes_text(activations + captured)}) need ~{bytes_text(need)} per GPU, which has "
            f"{bytes_text(min(totals))}: set gpus_per_shard = {max(fits, k + 1)} or lower max_tokens_per_batch")


def hybrid_kernels(model: str) -> str | None:
    """A hybrid (Gated DeltaNet) model on a GPU host without flash-linear-attention runs
    transformers' reference kernels: what that costs, and the one command that fixes it."""
    if (config := model_config(model)) is None:       # (reported elsewhere)
        return None
    try:
        from .model import HYBRID_MODEL_TYPES
    except Exception:                       # no torch
        return None
    kind = (config.get("text_config") or {}).get("model_type") or config.get("model_type")
    if kind not in HYBRID_MODEL_TYPES or importlib.util.find_spec("fla") is not None:
        return None
    return (f"{kind} is a Gated DeltaNet hybrid and flash-linear-attention is not installed: the "
            f"worker runs transformers' reference kernels, 6,573 instead of 10,440 tokens/s for a 27B "
            f"hybrid on an H200 (docs/benchmarks.md); fix: pip install 'flash-linear-attention>=0.4' "
            f"(or fleet[hybrid]) on the host")


def _error(message: str) -> protocol.Check:
    return protocol.Check("error", message)


def _warning(message: str) -> protocol.Check:
    return protocol.Check("warning", message)


def run(args: argparse.Namespace) -> protocol.PreflightReport:
    """Every check, in the order the report lists them: the host's GPUs and packages, the paths and
    the run's folder, the model and its layers, what the model and data are, the output folder,
    whether a shard fits its GPUs, and what the output will take."""
    report = protocol.PreflightReport(python=".".join(map(str, sys.version_info[:3])))
    checks = report.checks
    if sys.version_info < MIN_PYTHON:
        checks.append(_error(f"python {report.python} is older than {'.'.join(map(str, MIN_PYTHON))}"))
    reader = GpuReader()
    gpus = reader.read()
    report.telemetry = reader.source
    if args.builtin:
        checks += _worker_packages(report)
    report.gpu_count = max(len(gpus), report.cuda_devices or 0)
    report.gpus, found = _gpu_indices(args.gpus, args.device, report.gpu_count)
    uuids = {g.index: g.uuid for g in gpus}
    report.gpu_uuids = [u for i in report.gpus if isinstance(u := uuids.get(i), str) and u]
    checks += found + _grouping_checks(report.gpus, args.gpus_per_shard) + _path_checks(args)
    if args.run_dir:
        checks += _read_run_dir(args.run_dir, report)
    checks += _model_file_checks(args)
    shape = model_shape(args.model) if args.model else None
    layers, found = _layers(args, shape)
    report.identity, more = _identity(args, layers)
    checks += found + more + _dataset_checks(args, report.identity)
    if args.output:
        checks += _output_checks(args, report.identity)
    checks += _gpu_checks(args, shape, layers, gpus, report.gpus, report.gpu_count)
    if args.output:
        checks += _measure_output(args, shape, layers, report)
    if args.destination:
        checks += _destination_checks(args.destination, report, args)
    return report


def _destination_checks(url: str, report: protocol.PreflightReport, args: argparse.Namespace) -> list[protocol.Check]:
    """rclone is here and a file can be written, read and removed at the destination, with this
    host's own credentials: a bad bucket, key or host is refused before any GPU work. Then the
    host's upload rate to it is measured (fleet compares it with what its GPUs will write)."""
    from .identity import meta_mismatch
    from .ship import ShipError, check_reachable, destination, measure_uplink, owner_problem, rclone_binary, read_json_at
    try:
        dest = destination(url)
        rclone_binary()
    except ShipError as e:
        return [_error(str(e))]
    if not dest.is_store and (clashes := folder_clashes(f"destination {url}", dest.remote, args, args.output)):
        return [_error(p) for p in clashes]
    problem = check_reachable(dest, timeout=30)
    if problem:
        return [_error(problem)]
    if args.run_dir and (problem := owner_problem(dest, os.path.basename(args.run_dir), timeout=30)):
        return [_error(problem)]
    if report.identity.to_dict() and (diffs := meta_mismatch(read_json_at(dest, protocol.META_FILE, 30), report.identity)):
        return [_error(f"destination {url} holds another run's work (its meta.json): " + "; ".join(diffs)
                       + " — give this run another destination")]
    report.uplink_bps = measure_uplink(dest)
    return []


def _worker_packages(report: protocol.PreflightReport) -> list[protocol.Check]:
    """The built-in worker imports these; with torch present, its version and CUDA's own device
    count go in the report (CUDA may see GPUs that telemetry does not)."""
    missing = [m for m in ("torch", "transformers", "safetensors", "numpy")
               if importlib.util.find_spec(m) is None]
    if missing:
        return [_error(f"missing Python packages for the worker: {', '.join(missing)} "
                       f"(pip install 'fleet[worker]' on the host)")]
    try:
        report.torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:         # importable without its metadata (a source tree)
        report.torch = None
    if report.torch is None or any(os.path.exists(p) for p in GPU_DRIVER):   # no driver, no CUDA device:
        import torch                                                           # its import (1-2 s) would say 0
        report.torch = torch.__version__
        report.cuda_devices = torch.cuda.device_count()
    else:
        report.cuda_devices = 0
    return []


def _gpu_indices(spec: str, device: str, count: int) -> tuple[list[int], list[protocol.Check]]:
    """The GPU indices the shards will use: "all" of the host's (none: one shard on the CPU where
    the device allows it), or those listed, each of which must exist unless shards may fall back
    to the CPU."""
    if spec == "all":
        if count:
            return list(range(count)), []
        if device == "cpu":
            return [0], [_warning("no GPUs: gpus = \"all\" runs one shard on the CPU")]
        return [], [_error("no GPUs found for gpus = \"all\"; list gpus explicitly or set device = \"cpu\"")]
    resolved = [int(x) for x in spec.split(",")]
    bad = [g for g in resolved if g >= count] if device != "cpu" else []
    if not bad:
        return resolved, []
    return resolved, [protocol.Check("error" if device == "cuda" else "warning",
                                     f"GPU index {bad[0]} out of range: host has {count} GPU(s)"
                                     + ("" if device == "cuda" else "; shards will run on the CPU"))]


def _grouping_checks(resolved: list[int], k: int) -> list[protocol.Check]:
    """Shards of k GPUs each must use every GPU listed: a remainder would sit idle."""
    if k > 1 and len(resolved) % k:
        return [_error(f"{len(resolved)} GPU(s) {resolved} for gpus_per_shard = {k}: "
                       f"{len(resolved) % k} would sit idle; list a multiple of {k}")]
    return []


def _path_checks(args: argparse.Namespace) -> list[protocol.Check]:
    """The model and data paths given must exist on this host, as regular files or folders (a
    FIFO or a device would hang every reader: it is refused, and nothing reads it). A path that
    fails is dropped from `args`, so no later check opens it."""
    checks = []
    for label, path in (("model path", args.model), ("data path", args.data),
                        ("model config", os.path.join(args.model, "config.json") if args.model else "")):
        if not path or (label == "model config" and not os.path.lexists(path)):
            continue
        problem = _not_a_file_or_folder(path)
        if problem:
            checks.append(_error(f"{label} {path} {problem}"))
            if label == "data path":
                args.data = ""
            else:
                args.model = ""
    return checks


def _not_a_file_or_folder(path: str) -> str | None:
    """Why `path` cannot be read as a file or a folder: missing, or a FIFO, socket or device."""
    import stat
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read: {e.strerror or e}"
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return None
    return "is not a regular file or folder (a pipe or a device would never end)"


def _read_run_dir(run_dir: str, report: protocol.PreflightReport) -> list[protocol.Check]:
    """The run's plan on this host, and which machine this is (written at the first deploy)."""
    report.plan = read_plan(run_dir)
    try:
        report.host_id = host_id(os.path.dirname(os.path.abspath(run_dir)))
    except OSError as e:
        return [_error(f"cannot write this host's identity file under {os.path.dirname(run_dir)}: "
                       f"{e.strerror or e}")]
    return []


def _model_file_checks(args: argparse.Namespace) -> list[protocol.Check]:
    """The built-in worker's model folder (not the demo's, made on first use) needs a config with
    its shape and every weight file whole."""
    if not (args.builtin and args.model and os.path.isdir(args.model) and not args.demo):
        return []
    if model_shape(args.model) is None:
        return [_error(f"{args.model}/config.json is missing or has no hidden_size/num_hidden_layers")]
    problem = weight_files_problem(args.model)
    return [_error(problem)] if problem else []


def _layers(args: argparse.Namespace, shape) -> tuple[LayerPlan | None, list[protocol.Check]]:
    """The layers the built-in worker will capture, through its own resolver: the same ids, the
    same refusals (layers, format, dtype), before launch."""
    if not (args.builtin and shape):
        return None, []
    try:
        layers = resolve_layers(args.layers or args.format, shape.num_layers, None,
                                args.target_last_hidden_states)
        check_plan(args.format, layers)
        check_dtype(args.format, args.dtype)
    except (LayerError, FormatError) as e:
        return None, [_error(str(e))]
    return layers, []


def _identity(args: argparse.Namespace, layers: LayerPlan | None) -> tuple[protocol.WorkIdentity, list[protocol.Check]]:
    """What the model, the data and the output are, by which an output holding another run's work
    is known (empty, with the reason, where they cannot be read)."""
    try:
        output = output_identity(layers, args.format, args.loss_mask, args.dtype) if layers else {}
        model = args.model if args.builtin and args.model and os.path.isdir(args.model) else None
        data = args.data if args.data and os.path.exists(args.data) else None
        return work_identity(model, data, output), []
    except IdentityError as e:
        return protocol.WorkIdentity(), [_error(str(e))]


def _dataset_checks(args: argparse.Namespace, identity: protocol.WorkIdentity) -> list[protocol.Check]:
    """A JSON-lines dataset the built-in worker could do nothing with is refused (dataset_problem)."""
    if not (args.builtin and args.data and os.path.isfile(args.data) and not args.data.endswith(".parquet")):
        return []
    problem = dataset_problem(args.data, identity.data.rows if identity.data else None)
    return [_error(problem)] if problem else []


def _output_checks(args: argparse.Namespace, identity: protocol.WorkIdentity) -> list[protocol.Check]:
    """The output folder: names the file system can hold, not another run's (its owner file), and
    not holding other work (its meta.json)."""
    checks = [_error(f"output {args.output}: a folder name is {len(part.encode())} bytes long; "
                     f"file systems allow 255")
              for part in os.path.abspath(args.output).split(os.sep) if len(part.encode()) > 255]
    for folder in (args.output, *args.spill):
        if args.run_dir and (owner := folder_owner(folder)) not in (None, os.path.basename(args.run_dir)):
            checks.append(_error(f"output {folder} belongs to run {owner!r} ({OWNER_PATH}): give this run "
                                 f"another output, or remove that file if run {owner!r} is finished with"))
        checks += [_error(p) for p in folder_clashes(f"output {folder}", folder, args)]
    diffs = output_mismatch(args.output, identity) if identity.to_dict() else []
    if diffs:
        checks.append(_error(f"output {args.output} holds another run's work (its meta.json): "
                             + "; ".join(diffs) + " — use another output folder"))
    return checks


def folder_clashes(what: str, folder: str, args: argparse.Namespace, output: str | None = None) -> list[str]:
    """Why `folder` (an output, a spill folder, a destination) cannot hold this run's files: it is,
    is inside or holds the model folder or another run's output; it is or holds the data (its
    folder, or a save_to_disk folder; speculators' own layout, inside it, is fine) or fleet's
    state; it is a file system's root; or (a destination) it is tied to the run's `output`. One
    line each, naming both."""
    out = []
    run = os.path.basename(args.run_dir) if args.run_dir else None
    if os.path.dirname(os.path.realpath(folder)) == os.path.realpath(folder):
        out.append(f"{what} is the root of the file system: give the run a folder of its own")
    if args.model and (how := relation(folder, args.model)):
        out.append(f"{what} {how} the model folder {args.model}: the samples would be written among "
                   f"its weights; give the run a folder of its own")
    if args.data:
        data_folder = args.data if os.path.isdir(args.data) else os.path.dirname(os.path.abspath(args.data))
        if (how := relation(folder, data_folder)) in ("is", "holds"):
            out.append(f"{what} {how} the data's folder {data_folder}: give the run a folder of its own")
    if args.run_dir and (how := relation(folder, args.run_dir)) in ("is", "holds"):
        out.append(f"{what} {how} fleet's folder for the run {args.run_dir}: give the run another")
    if output is not None and (how := relation(folder, output)):
        out.append(f"{what} {how} the run's output {output}: the destination is where the output goes")
    for other, owner in run_outputs_near(folder):
        if owner != run and os.path.realpath(other) != os.path.realpath(folder):   # (itself: checked above)
            how = relation(folder, other)
            out.append(f"{what} {how} run {owner!r}'s output {other}: no folder holds two runs; give "
                       f"this run another")
    return out


def _gpu_checks(args: argparse.Namespace, shape, layers: LayerPlan | None, gpus: list[protocol.GpuStat],
                resolved: list[int], count: int) -> list[protocol.Check]:
    """On GPUs, the built-in worker's first shard must fit its GPUs (fit_problem), and a hybrid
    model without its fast kernels is worth a warning (hybrid_kernels)."""
    checks = []
    if args.builtin and shape and args.device != "cpu":
        k = args.gpus_per_shard
        if problem := fit_problem(args.model, shape, [g for g in gpus if g.index in resolved[:k]],
                                  k, args.max_tokens_per_batch, len(layers.ids) if layers else 4):
            checks.append(_error(problem))
    if args.builtin and args.model and args.device != "cpu" and count and (warning := hybrid_kernels(args.model)):
        checks.append(_warning(warning))
    return checks


def _measure_output(args: argparse.Namespace, shape, layers: LayerPlan | None,
                    report: protocol.PreflightReport) -> list[protocol.Check]:
    """Free space and the folder's id at the output, whether it is writable, and (built-in worker)
    the output's projected size and, with rows still to write, the disks' write rate; a projection
    that fails must not stop the run: it says why."""
    checks: list[protocol.Check] = []
    devices: dict[int, int] = {}
    for folder in (args.output, *args.spill):        # several disks: their free space summed
        space = disk_space(folder)
        devices.setdefault(os.stat(space.probe).st_dev, space.free)
        if not os.access(space.probe, os.W_OK):
            checks.append(_error(f"output {folder}: {space.probe} is not writable"))
    report.free_bytes = sum(devices.values())
    report.folder_id = _folder_id(args.output)
    if args.builtin and shape and layers and args.data and os.path.exists(args.data):
        try:
            fp = footprint(args.data, args.output, Layout(args.format, layers, args.dtype), shape.hidden_size,
                           args.max_length, args.too_long, shape.max_positions)
        except Exception as e:
            checks.append(_warning(f"output size not projected: {type(e).__name__}: {e}"))
        else:
            report.footprint = fp
            report.estimated_bytes = sum(fp.remaining)
            if report.estimated_bytes:                # fleet compares it with what the GPUs will write
                report.write_bps = write_rate([args.output, *args.spill])
    return checks


HOST_ID_FILE = "host-id"


def host_id(root: str) -> str:
    """Which machine this is: a random id written under the host's root at its first deploy and
    read back ever after. The run's plan records it per host name, so a fleet.toml whose names
    now point at other machines (swapped after `fleet down`) is refused before any launch."""
    path = os.path.join(root, HOST_ID_FILE)
    try:
        with open(path) as f:
            text = f.read().strip()
        if text:
            return text
    except FileNotFoundError:
        pass
    import socket
    import uuid
    os.makedirs(root, exist_ok=True)
    made = f"{socket.gethostname()}-{uuid.uuid4().hex[:12]}"
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(made + "\n")
    try:
        os.link(tmp, path)                # the first of two deploys at once wins; both read it
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    with open(path) as f:
        return f.read().strip()


def _folder_id(output: str) -> str | None:
    """The output folder's id (its meta.json), by which hosts sharing one folder are known."""
    try:
        with open(os.path.join(output, protocol.META_FILE)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return None
    return meta.get("folder_id") if isinstance(meta, dict) else None


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
    ap.add_argument("--max-length", type=int, default=None, help="as the worker's (for the footprint)")
    ap.add_argument("--too-long", default="skip", help="as the worker's (for the footprint)")
    ap.add_argument("--target-last-hidden-states", action="store_true")
    ap.add_argument("--loss-mask", default="assistant", help="accepted as the worker takes it")
    ap.add_argument("--run-dir", default=None, help="the run's folder: its plan.json is reported")
    ap.add_argument("--gpus-per-shard", type=int, default=1)
    ap.add_argument("--max-tokens-per-batch", type=int, default=16384)
    ap.add_argument("--spill", action="append", default=[], help="the output's other disks' folders")
    ap.add_argument("--destination", default=None, help="where the output is shipped: checked reachable")
    ap.add_argument("--builtin", action="store_true", help="the built-in extraction worker runs here")
    ap.add_argument("--demo", action="store_true", help="model and data are made on first use")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    print(run(parse_args(argv)).to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
