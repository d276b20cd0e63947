"""Worker runs in every format on the tiny model, shared by the format, verify and export tests."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_worker

L, H, MAX_LEN = 8, 64, 4096
ROWS = 10
UNSUPERVISED = 3                          # a row whose loss_mask is all 0: recorded as skipped

# name -> (format, --layers, expected hs ids, norm of hs[L], DSpark key)
CASES = {
    "speculators": ("speculators", "speculators", [2, 4, 5, 8], "pre", False),
    "speculators-dflash": ("speculators", "speculators-dflash", [2, 4, 5, 8], "pre", False),
    "specforge-eagle3": ("specforge-eagle3", None, [2, 4, 5, 8], "post", False),
    "eagle3-official": ("specforge-eagle3", "eagle3", [2, 4, 5, 8], "post", False),
    "specforge-dflash": ("specforge-dflash", "specforge-dflash:3", [2, 4, 6], "none", False),
    "dspark": ("specforge-dflash", "from:{dspark}", [2, 4, 6, 8], "post", True),
    "eagle": ("eagle", None, [8], "post", False),
}


@pytest.fixture(scope="session")
def prepared(tmp_path_factory, token_data):
    """A speculators-style prepared dataset (save_to_disk: input_ids, loss_mask, seq_len): the
    worker reads it as it is, and speculators' ArrowDataset reads it beside the worker's files."""
    import datasets
    rows = [json.loads(l) for l in open(token_data)][:ROWS]
    rows[UNSUPERVISED]["loss_mask"] = [0] * len(rows[UNSUPERVISED]["input_ids"])
    for r in rows:
        r["seq_len"] = len(r["input_ids"])
    path = str(tmp_path_factory.mktemp("prepared") / "data")
    ds = datasets.Dataset.from_list(rows)
    ds.set_format("torch")                   # as speculators' prepare-data saves it
    ds.save_to_disk(path)
    return path, rows


@pytest.fixture(scope="session")
def dspark_config(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("draft") / "config.json"
    path.write_text(json.dumps({"architectures": ["DSparkDraftModel"], "num_hidden_layers": 3,
                                "num_target_layers": L, "dflash_config": {"target_layer_ids": [1, 3, 5]}}))
    return str(path)


@pytest.fixture(scope="session")
def runs(tmp_path_factory, dense_model, prepared, dspark_config) -> dict[str, str]:
    """One real worker run (fp32 model, so the reference comparison is tight) per case."""
    outs = {}
    for name, (fmt, layers, *_ ) in CASES.items():
        out = str(tmp_path_factory.mktemp(name) / "out")
        args = ["--model", dense_model, "--data", prepared[0], "--out", out, "--format", fmt,
                "--model-dtype", "fp32", "--max-tokens-per-batch", "512",
                "--max-skip-fraction", "0.5"]      # the unsupervised row is skipped on purpose
        if layers:
            args += ["--layers", layers.format(dspark=dspark_config)]
        r = run_worker(*args)
        assert r.returncode == 0, (name, r.stderr)
        outs[name] = out
    return outs


@pytest.fixture(scope="session")
def reference(dense_model, prepared):
    """output_hidden_states of every row, one at a time (fp32), and the final norm."""
    from worker.model import find_decoder, load_model
    model = load_model(dense_model, "cpu", torch.float32)
    refs = []
    with torch.inference_mode():
        for row in prepared[1]:
            out = model(input_ids=torch.tensor([row["input_ids"]]), output_hidden_states=True)
            refs.append([h[0] for h in out.hidden_states])
    return refs, find_decoder(model).norm


