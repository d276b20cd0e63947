"""Files the real worker writes in each trainer's format, read back by that trainer's own reader
code, with values checked against transformers' output_hidden_states.

Readers (installed by scripts/test.sh with --no-deps; only the reader modules are imported):
speculators 0.9 `speculators.train.data.ArrowDataset` (through hs_connectors' FileTransfer);
SpecForge 0.2 `OfflineManifestReader` built by each algorithm's own `build_offline_reader`,
`feature_store.load_feature_file`, the per-sample normalisers and the collators. EAGLE-1/2 is not
on PyPI: its loader contract (eagle/train/main.py) is written down in `eagle_load` and tested.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from worker.verify import verify

from tests.worker.conftest import CASES, H, L, MAX_LEN, ROWS, UNSUPERVISED


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-2) -> bool:
    return float((a.float() - b.float()).norm() / b.float().norm()) < tol


def check_states(got: torch.Tensor, ref: list[torch.Tensor], ids: list[int], norm_of_last: str, norm) -> None:
    """got [T, n, H] against hs[ids]; hs[L] pre-norm is checked through the model's norm."""
    assert got.dtype == torch.bfloat16 and got.shape[1:] == (len(ids), H)
    for slot, k in enumerate(ids):
        if k == L and norm_of_last == "pre":
            with torch.inference_mode():
                assert close(norm(got[:, slot].float()), ref[L])
            assert not close(got[:, slot], ref[L], 5e-2)         # it really is the raw state
        else:
            assert close(got[:, slot], ref[k]), (k, slot)


def written(rows) -> list[int]:
    return [i for i in range(len(rows)) if i != UNSUPERVISED]


def test_meta_records_format_layers_and_trainer_setting(runs, dspark_config):
    for name, (fmt, layers, ids, norm, dspark) in CASES.items():
        meta = json.load(open(os.path.join(runs[name], "meta.json")))
        assert (meta["format"], meta["layer_ids"], meta["last_layer_norm"]) == (fmt, ids, norm), name
        assert meta["target_last_hidden_states"] is dspark
        assert meta["loss_mask"] == "assistant"
    setting = lambda n: json.load(open(os.path.join(runs[n], "meta.json")))["trainer_setting"]
    assert setting("speculators") == "--target-layer-ids 2 4 5"
    assert setting("specforge-eagle3") == "model.aux_hidden_state_layer_ids = [1, 3, 4]"
    assert setting("eagle3-official") == "model.aux_hidden_state_layer_ids = [1, 3, 4]"
    assert setting("specforge-dflash") == "dflash_config.target_layer_ids = [1, 3, 5]"
    assert setting("dspark") == "dflash_config.target_layer_ids = [1, 3, 5]"     # as its config says
    assert setting("eagle").startswith("none")
    assert json.load(open(os.path.join(runs["dspark"], "meta.json")))["layers"] == f"from:{dspark_config}"


@pytest.mark.parametrize("name", ["speculators", "speculators-dflash"])
def test_speculators_arrow_dataset_reads_our_files(runs, prepared, reference, name):
    data = pytest.importorskip("speculators.train.data")
    from hs_connectors import FileTransfer
    from speculators.train.recovery import SampleUnavailable
    _, _, ids, norm_of_last, _ = CASES[name]
    refs, norm = reference
    ds = data.ArrowDataset(max_len=MAX_LEN, datapath=prepared[0], transfer=FileTransfer(Path(runs[name])),
                           on_missing="skip")
    rows = prepared[1]
    items = []
    for i in written(rows):
        item = ds[i]
        T = len(rows[i]["input_ids"])
        assert item["input_ids"].tolist() == rows[i]["input_ids"]
        assert item["loss_mask"].tolist() == rows[i]["loss_mask"]     # speculators takes its own mask
        # its drafter input: hidden_states[:, :-1] flattened; its verifier state: [:, -1], which it norms
        got = torch.cat([item["hidden_states"].view(T, -1, H), item["verifier_last_hidden_states"][:, None]], 1)
        check_states(got, refs[i], ids, norm_of_last, norm)
        items.append(item)
    # a sample recorded as skipped has no file: --on-missing skip passes over it (raise would stop)
    assert isinstance(ds[UNSUPERVISED], SampleUnavailable)
    batch = data.CollateFn(MAX_LEN, H, num_target_layers=3)(items + [ds[UNSUPERVISED]])
    assert batch["hidden_states"].shape == (1, MAX_LEN, 3 * H) and batch["error_records"] == 1


def specforge_refs(reader) -> dict[int, str]:
    """SpecForge's reader lists the files it will train on; their paths name our indices."""
    paths = [ref.feature_store_uri.removeprefix("file://") for ref in reader.read()]
    return {int(re.search(r"data_(\d+)\.ckpt$", p).group(1)): p for p in paths}


@pytest.mark.parametrize("name", ["specforge-eagle3", "eagle3-official"])
def test_specforge_eagle3_offline_reader_normaliser_and_collator(runs, prepared, reference, name):
    eagle3 = pytest.importorskip("specforge.algorithms.eagle3.data")
    from specforge.runtime.data_plane.feature_store import load_feature_file
    refs, norm = reference
    rows = prepared[1]
    reader = eagle3.build_offline_reader(runs[name], run_id="t", ttt_length=7, max_len=MAX_LEN)
    reader.validate_files = True             # its eager pass: every file opened, keys checked
    files = specforge_refs(reader)
    assert sorted(files) == written(rows)    # manifest/ and meta.json are not taken for samples
    samples = []
    for i, path in files.items():
        raw = load_feature_file(path)
        assert raw["input_ids"].dtype == torch.int64 and raw["loss_mask"].dtype == torch.int64
        s = eagle3.normalize_offline_sample(raw, max_len=MAX_LEN)
        T = len(rows[i]["input_ids"])
        assert s["input_ids"][0].tolist() == rows[i]["input_ids"]
        assert s["loss_mask"][0].tolist() == rows[i]["loss_mask"][:-1] + [0]   # it drops the last
        got = torch.cat([s["hidden_state"][0].view(T, 3, H), s["target"][0][:, None]], 1)
        check_states(got, refs[i], [2, 4, 5, 8], "post", norm)
        samples.append(s)
    batch = eagle3.build_offline_collator()(samples[:3])
    longest = max(s["input_ids"].shape[1] for s in samples[:3])
    assert batch["hidden_state"].shape == (3, longest, 3 * H) and batch["target"].shape == (3, longest, H)


@pytest.mark.parametrize("name", ["specforge-dflash", "dspark"])
def test_specforge_dflash_offline_reader_normaliser_and_collator(runs, prepared, reference, name):
    fam = pytest.importorskip("specforge.algorithms.common.dflash_family_data")
    from specforge.runtime.data_plane.feature_store import load_feature_file
    refs, norm = reference
    rows = prepared[1]
    dspark = name == "dspark"
    build = fam.build_dspark_offline_reader if dspark else fam.build_offline_reader
    reader = build(name, runs[name], run_id="t", ttt_length=1, max_len=MAX_LEN)
    reader.validate_files = True
    files = specforge_refs(reader)
    assert sorted(files) == written(rows)
    normalise = fam.normalize_dspark_offline_sample if dspark else fam.normalize_offline_sample
    samples = []
    for i, path in files.items():
        s = normalise(load_feature_file(path), max_len=MAX_LEN)
        T = len(rows[i]["input_ids"])
        assert s["input_ids"][0].tolist() == rows[i]["input_ids"]
        assert s["loss_mask"][0].tolist() == rows[i]["loss_mask"]
        parts = [s["hidden_states"][0].view(T, 3, H)]
        if dspark:
            parts.append(s["target_last_hidden_states"][0][:, None])
        check_states(torch.cat(parts, 1), refs[i], CASES[name][2], CASES[name][3], norm)
        samples.append(s)
    batch = (fam.build_dspark_collator() if dspark else fam.build_collator())(samples[:3])
    longest = max(s["input_ids"].shape[1] for s in samples[:3])
    assert batch["hidden_states"].shape == (3, longest, 3 * H)


def eagle_load(data_path: str, max_len: int = 2048) -> list[dict]:
    """EAGLE-1/2's loader contract (eagle/train/main.py: list_files + CustomDataset.__getitem__):
    every file under the data path is torch.load'ed; `hidden_state` [T, H] (final-normed),
    `input_ids` [T], `loss_mask` [T] are cut to max_len and get a batch axis."""
    paths = [os.path.join(root, f) for root, _, files in os.walk(data_path) for f in files]
    items = []
    for p in paths:
        data = torch.load(p)
        loss_mask = data["loss_mask"][:max_len][None, :][0].tolist()
        loss_mask[-1] = 0
        items.append({"path": p, "hidden_state_big": data["hidden_state"][:max_len][None, :],
                      "input_ids": data["input_ids"][:max_len][None, :], "loss_mask": loss_mask})
    return items


def test_eagle_loader_contract(runs, prepared, reference):
    refs, norm = reference
    rows = prepared[1]
    meta = json.load(open(os.path.join(runs["eagle"], "meta.json")))
    assert meta["data_dir"] == os.path.join(os.path.abspath(runs["eagle"]), "data")
    assert {"manifest", "meta.json", "data"} <= set(os.listdir(runs["eagle"]))
    items = eagle_load(meta["data_dir"])                 # every file under it must be a sample
    assert sorted(int(re.search(r"data_(\d+)\.ckpt$", it["path"]).group(1)) for it in items) == written(rows)
    for it in items:
        i = int(re.search(r"data_(\d+)\.ckpt$", it["path"]).group(1))
        assert it["input_ids"][0].tolist() == rows[i]["input_ids"]
        assert it["loss_mask"] == rows[i]["loss_mask"][:-1] + [0]
        check_states(it["hidden_state_big"][0][:, None], refs[i], [8], "post", norm)


def test_ckpt_files_hold_only_their_sample(runs, prepared):
    """torch.save writes a view's whole storage: each file must hold one sample's bytes only."""
    rows = prepared[1]
    for name, per_token in (("specforge-eagle3", 4 * H * 2 + 16), ("eagle", H * 2 + 16)):
        for i in written(rows)[:4]:
            path = [p for p in Path(runs[name]).rglob(f"data_{i}.ckpt")][0]
            assert os.path.getsize(path) < len(rows[i]["input_ids"]) * per_token + 4096, (name, i)


@pytest.mark.parametrize("name", list(CASES))
def test_verify_every_format_finds_a_truncated_file_and_a_missing_sample(runs, prepared, tmp_path, name):
    import shutil
    from worker.formats import Layout
    from worker.verify import layout_of
    out = str(tmp_path / "copy")
    shutil.copytree(runs[name], out)
    clean = verify(out)
    assert clean["problems"] == [] and clean["format"] == CASES[name][0]
    assert clean["checked"] == ROWS - 1 and list(clean["skipped"]) == [str(UNSUPERVISED)]
    layout: Layout = layout_of(json.load(open(os.path.join(out, "meta.json"))))
    cut, gone = layout.path(out, 1), layout.path(out, 2)
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) // 2)
    os.unlink(gone)
    problems = verify(out)["problems"]
    assert len(problems) == 2
    assert any(p.startswith(f"sample 1: {cut} unreadable") for p in problems), problems
    assert f"sample 2: {gone} missing" in problems
