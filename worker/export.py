"""`python -m worker.export SRC --format F --out DST`: convert a finished (or partial) run to
another trainer's layout, without the GPU.

Every sample SRC's manifests record is read through SRC's layout and written through DST's, with
the same atomic write and manifest as the extractor, so an export that is stopped resumes where it
stopped. Samples recorded as skipped stay skipped. fp8 stays fp8 where DST's reader dequantises it
(speculators: the same bytes) and is written as bf16 where it cannot (exactly the values
speculators' reader would have seen). Layers stay as they are (EAGLE-1/2 keeps hs[L] alone): a format that needs states SRC does not hold (hs[L] post-norm from a pre-norm run) is
refused; re-extract for it.
Progress goes to stderr; the last line on stdout is one JSON summary (what `fleet export` reads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from . import protocol
from .formats import FORMATS, FormatError, Layout, supervision_problem, trainer_setting
from .layers import LayerPlan
from .verify import layout_of
from .files import relation, run_outputs_near
from .writer import (DiskFullError, Manifest, OwnerError, claim_output, load_finished, manifest_path, remove_stale_temps,
                     write_json_atomic, write_sample_file)

EXIT_PROBLEMS, EXIT_USAGE = 1, 2
CHUNK = 64


class ExportError(Exception):
    """SRC or DST cannot be used as asked (one line for the user)."""


def open_source(src: str) -> tuple[dict, Layout]:
    try:
        with open(os.path.join(src, protocol.META_FILE)) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise ExportError(f"{src}: no {protocol.META_FILE} (not an output folder of the worker)") from None
    except (OSError, ValueError) as e:
        raise ExportError(f"{src}/{protocol.META_FILE}: unreadable: {e}") from None
    return meta, layout_of(meta)


def target_layout(fmt: str, plan: LayerPlan, dtype: str = "bf16") -> Layout:
    """The same layers in `fmt`; EAGLE-1/2 keeps only hs[L] (post-norm) of them. fp8 where the
    format's reader dequantises it, else bf16."""
    from .formats import FP8_READERS
    if fmt == "eagle" and plan.num_layers in plan.ids and plan.last_layer_norm == "post":
        plan = LayerPlan((plan.num_layers,), "post", plan.num_layers)
    try:
        return Layout(fmt, plan, dtype if fmt in FP8_READERS else "bf16")
    except FormatError as e:
        raise ExportError(f"cannot export to {fmt}: {e}") from None


def convert(src: str, src_layout: Layout, dst: str, dst_layout: Layout, index: int) -> dict:
    """Read one sample, write it in the new layout; its manifest record."""
    tensors, _ = src_layout.load(src_layout.path(src, index))
    hidden, ids, mask = src_layout.unpack(tensors)
    if dst_layout.plan.ids != src_layout.plan.ids:
        hidden = hidden[:, [src_layout.plan.ids.index(k) for k in dst_layout.plan.ids]]
    if problem := supervision_problem(dst_layout.format, mask.numpy().astype(bool)):
        return {"index": index, "skipped": problem}
    packed = dst_layout.pack(hidden, ids, mask)
    size = write_sample_file(dst_layout, dst, index, packed, dict(dst_layout.header(), sample_index=str(index)))
    return {"index": index, "tokens": int(ids.shape[0]), "bytes": size}


def export(src: str, fmt: str, dst: str, threads: int = 4, progress=None) -> protocol.ExportSummary:
    """Every sample SRC records and DST does not yet, converted into DST in `fmt`: DST's meta.json
    first, then the files in chunks (each chunk's manifest lines once its files are written), then
    what speculators reads beside them. `progress(done, total, seconds)` after each chunk."""
    meta, src_layout = open_source(src)
    dst_layout = target_layout(fmt, src_layout.plan, src_layout.dtype)
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ExportError(f"{dst}: the output must be another folder than the source")
    records = load_finished(src)
    done = load_finished(dst)
    todo = sorted(i for i in records if i not in done)
    os.makedirs(dst, exist_ok=True)
    _check_destination(src, dst, fmt, dst_layout)
    _write_meta(src, dst, fmt, meta, dst_layout)
    with _claim(dst):                                     # one export into dst at a time
        remove_stale_temps(dst, 0, 1 << 62)               # what a killed export left
        manifest = Manifest(manifest_path(dst, "export"))
        summary = protocol.ExportSummary(source=src, out=dst, format=fmt, dtype=dst_layout.dtype,
                                         to_do=len(todo))
        _convert_all(todo, lambda i: _export_one(src, src_layout, dst, dst_layout, records[i]),
                     manifest, summary, threads, progress)
        if fmt == "speculators":               # what speculators train reads beside the files
            from .prepared import write_prepared
            write_prepared(dst)
    return summary


def _claim(dst: str):
    """The export's lock on DST (claim_output's open lock file), held until the export ends: a
    second export into DST at once is refused (ExportError)."""
    try:
        return claim_output(dst, None, None, "export")
    except OwnerError as e:
        raise ExportError(str(e)) from None


def _check_destination(src: str, dst: str, fmt: str, dst_layout: Layout) -> None:
    """A DST that already holds an export resumes only if it is of the same source, format, layers
    and dtype; anything else is refused (ExportError) rather than mixed in: the source itself (or a
    folder in it, or holding it, links followed), a run's output (its owner file, or a meta.json
    that is no export's), another export."""
    if how := relation(dst, src):
        raise ExportError(f"--out {dst} {how} the output it would export ({src}): use another --out")
    for folder, run in run_outputs_near(dst, depth=1):
        raise ExportError(f"--out {dst} {relation(dst, folder)} run {run!r}'s output {folder}: use another --out")
    if not os.path.exists(os.path.join(dst, protocol.META_FILE)):
        return
    old = json.load(open(os.path.join(dst, protocol.META_FILE)))
    if not old.get("exported_from"):
        raise ExportError(f"--out {dst} holds a run's output (its meta.json is no export's): use another --out")
    old_layout = layout_of(old)
    if old.get("format") != fmt or old.get("layer_ids") != list(dst_layout.plan.ids) \
            or old_layout.dtype != dst_layout.dtype:
        raise ExportError(f"{dst} already holds format {old.get('format')} with layers "
                          f"{old.get('layer_ids')} in {old_layout.dtype}: use another --out")
    source = old.get("exported_from")
    if relation(source, src) != "is":
        raise ExportError(f"{dst} holds an export of {source}, not of {src}: use another --out "
                          f"(or remove {dst} to export there afresh)")


def _write_meta(src: str, dst: str, fmt: str, meta: dict, dst_layout: Layout) -> None:
    """DST's meta.json: SRC's, less fp8 scales, with DST's format, layers, dtype, data folder and
    trainer setting, and where it was exported from."""
    plan = dst_layout.plan
    meta = {k: v for k, v in meta.items() if k != "hidden_states_scales"}
    identity = meta.get("identity")
    if isinstance(identity, dict):
        meta["identity"] = {**identity, "dtype": dst_layout.dtype}
    write_json_atomic(os.path.join(dst, protocol.META_FILE),
                      dict(meta, **dst_layout.stored(), format=fmt,
                           data_dir=os.path.abspath(dst_layout.data_dir(dst)),
                           layer_ids=list(plan.ids), last_layer_norm=plan.last_layer_norm,
                           trainer_setting=trainer_setting(fmt, plan, dst_layout.dtype),
                           exported_from=os.path.abspath(src)))


def _export_one(src: str, src_layout: Layout, dst: str, dst_layout: Layout, rec: dict) -> dict:
    """One sample's manifest record in DST: a skip stays a skip; a source file that cannot be read
    is a problem (the rest goes on); a full disk stops the export."""
    if "skipped" in rec:
        return rec
    i = rec["index"]
    try:
        return convert(src, src_layout, dst, dst_layout, i)
    except DiskFullError:
        raise
    except Exception as e:            # a damaged source file: reported, the rest goes on
        return {"index": i, "problem": f"sample {i}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}


def _convert_all(todo: list[int], one, manifest: Manifest, summary: protocol.ExportSummary, threads: int,
                 progress) -> None:
    """The samples in chunks of CHUNK, converted in parallel; each chunk's records go in the
    manifest (problems do not: the next export tries them again) and are counted in the summary."""
    t0 = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        for start in range(0, len(todo), CHUNK):
            results = list(pool.map(one, todo[start:start + CHUNK]))
            manifest.append([r for r in results if "problem" not in r])
            for r in results:
                if "problem" in r:
                    summary.problems.append(r["problem"])
                elif "skipped" in r:
                    summary.skipped += 1
                else:
                    summary.written += 1
            if progress:
                progress(min(start + CHUNK, len(todo)), len(todo), time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.export",
                                 description="Convert an output folder of the worker to another "
                                             "trainer's layout.")
    ap.add_argument("src", help="the output folder to read (its meta.json says its format)")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--out", required=True, help="the folder to write")
    ap.add_argument("--threads", type=int, default=4, help="files converted in parallel")
    args = ap.parse_args(argv)

    def progress(done: int, total: int, seconds: float) -> None:
        print(f"export: {done}/{total} samples ({100 * done // max(total, 1)}%), {seconds:.0f} s",
              file=sys.stderr, flush=True)

    try:
        summary = export(args.src, args.format, args.out, max(args.threads, 1), progress)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except DiskFullError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_PROBLEMS
    for p in summary.problems[:20]:
        print(f"problem: {p}", file=sys.stderr)
    print(f"export: {summary.written} written, {summary.skipped} skipped, "
          f"{len(summary.problems)} problem(s) -> {args.out}", file=sys.stderr)
    print(summary.to_json())
    return EXIT_PROBLEMS if summary.problems else 0


if __name__ == "__main__":
    sys.exit(main())
