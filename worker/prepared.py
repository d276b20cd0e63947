"""speculators' prepared dataset, written beside the worker's own files: `<out>/prepared/`.

`speculators train --data-path <out>/prepared` reads a `datasets.save_to_disk` folder (rows
`input_ids`, `loss_mask`, `seq_len`, torch format) and the hidden states of row k from
`<data-path>/hidden_states/hs_<k>.safetensors`; its ArrowDataset drops a row whose file's
`token_ids` differ from the row's `input_ids` ("Cached token ids do not match"). Its own
`prepare-data` renders through vLLM, splits rows per assistant turn and shuffles them, so its rows
never line up with ours. Here the rows are read back from the written files themselves (the
worker's tokenization and loss mask, byte for byte), one row per written sample in index order,
and `hidden_states/hs_<k>` is a relative symlink to that sample's `hs_<index>.safetensors`: dense
rows, every written sample used, skipped rows absent.

Written with pyarrow alone (the worker does not depend on `datasets`), in the exact layout
`save_to_disk` writes. Rebuilt whole, under a lock, by whichever process finishes last.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid

from . import protocol
from .writer import load_finished

FOLDER = "prepared"
_ARROW = "data-00000-of-00001.arrow"
_FEATURES = {"input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
             "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
             "seq_len": {"dtype": "int64", "_type": "Value"}}


def path(out: str) -> str:
    return os.path.join(out, FOLDER)


def write_prepared(out: str) -> int:
    """(Re)write `<out>/prepared` from every sample the manifests record as written; the row count.
    The samples' own `token_ids`/`loss_mask` are read back (int64, as speculators compares them)."""
    import pyarrow as pa
    from safetensors import safe_open

    with open(os.path.join(out, ".prepared.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        ids_col, mask_col, lens, written = [], [], [], []
        for i in sorted(i for i, rec in load_finished(out).items() if "skipped" not in rec):
            try:
                with safe_open(os.path.join(out, f"hs_{i}.safetensors"), framework="numpy") as f:
                    ids, mask = f.get_tensor("token_ids"), f.get_tensor("loss_mask")
            except Exception:            # missing or damaged: left out (verify names the file)
                continue
            written.append(i)
            ids_col.append(ids.astype("int64"))
            mask_col.append(mask.astype("int64"))
            lens.append(len(ids))
        hf = json.dumps({"info": {"features": _FEATURES}})
        schema = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                            ("seq_len", pa.int64())], metadata={"huggingface": hf})
        table = pa.table([pa.array(ids_col, pa.list_(pa.int64())), pa.array(mask_col, pa.list_(pa.int64())),
                          pa.array(lens, pa.int64())], schema=schema)
        tmp = os.path.join(out, f"{protocol.TEMP_PREFIX}prepared-{uuid.uuid4().hex[:8]}")
        os.makedirs(os.path.join(tmp, "hidden_states"))
        with pa.OSFile(os.path.join(tmp, _ARROW), "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
            w.write_table(table)
        _json(os.path.join(tmp, "state.json"), {
            "_data_files": [{"filename": _ARROW}], "_fingerprint": uuid.uuid4().hex[:16],
            "_format_columns": None, "_format_kwargs": {}, "_format_type": "torch",
            "_output_all_columns": False, "_split": None})
        _json(os.path.join(tmp, "dataset_info.json"), {"citation": "", "description": "",
                                                       "features": _FEATURES, "homepage": "", "license": ""})
        for k, i in enumerate(written):
            os.symlink(os.path.join("..", "..", f"hs_{i}.safetensors"),
                       os.path.join(tmp, "hidden_states", f"hs_{k}.safetensors"))
        final = path(out)
        old = None
        if os.path.exists(final):
            old = f"{tmp}-old"
            os.rename(final, old)
        os.rename(tmp, final)
        if old:
            shutil.rmtree(old)
        return len(written)


def _json(p: str, obj: dict) -> None:
    with open(p, "w") as f:
        json.dump(obj, f, indent=2)


def check_prepared(out: str) -> str | None:
    """Why `<out>/prepared` does not match the written samples (missing, stale), or None."""
    written = sum(1 for rec in load_finished(out).values() if "skipped" not in rec)
    links = os.path.join(path(out), "hidden_states")
    if not os.path.isdir(links):
        return f"{path(out)} missing (speculators train reads it): run python -m worker.prepared {out}"
    have = sum(1 for n in os.listdir(links) if n.startswith("hs_"))
    if have != written:
        return (f"{path(out)} holds {have} rows, the manifests {written} written samples: "
                f"run python -m worker.prepared {out}")
    return None


def main(argv: list[str] | None = None) -> int:
    import sys
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m worker.prepared OUT  (rewrites OUT/prepared for speculators train)",
              file=sys.stderr)
        return 2
    print(f"{path(args[0])}: {write_prepared(args[0])} rows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
