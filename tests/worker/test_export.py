"""`python -m worker.export`: an existing run converted to another trainer's layout, bit for bit,
resumably, with progress and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from worker.formats import Layout
from worker.verify import layout_of, verify
from tests.conftest import REPO
from tests.worker.conftest import ROWS, UNSUPERVISED


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker.export", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def samples(out: str) -> dict[int, tuple]:
    layout: Layout = layout_of(json.load(open(os.path.join(out, "meta.json"))))
    return {i: layout.unpack(layout.load(p)[0]) for i, p in layout.scan(out).items()}


def test_round_trip_is_bit_exact(runs, tmp_path):
    src = runs["specforge-dflash"]                               # hs [2, 4, 6]: no hs[L]
    to_spec, back = str(tmp_path / "speculators"), str(tmp_path / "back")
    r = export(src, "--format", "speculators", "--out", to_spec)
    assert r.returncode == 0, r.stderr
    assert f"export: {ROWS}/{ROWS} samples (100%)" in r.stderr        # progress (the skipped one too)
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert (summary["written"], summary["skipped"], summary["problems"]) == (ROWS - 1, 1, [])
    assert export(to_spec, "--format", "specforge-dflash", "--out", back).returncode == 0
    original, returned = samples(src), samples(back)
    assert sorted(original) == sorted(returned) and UNSUPERVISED not in original
    for i in original:
        for a, b in zip(original[i], returned[i]):
            assert torch.equal(a.to(b.dtype), b), i
    for out in (to_spec, back):
        rep = verify(out)
        assert rep["problems"] == [] and list(rep["skipped"]) == [str(UNSUPERVISED)]
    meta = json.load(open(os.path.join(back, "meta.json")))
    assert meta["format"] == "specforge-dflash" and meta["exported_from"] == os.path.abspath(to_spec)
    assert meta["trainer_setting"] == "dflash_config.target_layer_ids = [1, 3, 5]"
    # speculators train reads the exported folder's prepared dataset: one row per written sample
    from worker.prepared import check_prepared
    assert check_prepared(to_spec) is None and len(os.listdir(os.path.join(to_spec, "prepared", "hidden_states"))) == ROWS - 1


def test_to_eagle_keeps_the_final_state_only(runs, tmp_path):
    out = str(tmp_path / "eagle")
    assert export(runs["specforge-eagle3"], "--format", "eagle", "--out", out).returncode == 0
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["layer_ids"] == [8] and meta["data_dir"] == os.path.join(os.path.abspath(out), "data")
    src, got = samples(runs["specforge-eagle3"]), samples(out)
    for i in src:
        assert torch.equal(got[i][0][:, 0], src[i][0][:, 3])
    assert verify(out)["problems"] == []


def test_resume_does_nothing_twice(runs, tmp_path):
    out = str(tmp_path / "dflash")
    assert export(runs["specforge-dflash"], "--format", "speculators", "--out", out).returncode == 0
    again = export(runs["specforge-dflash"], "--format", "speculators", "--out", out)
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert again.returncode == 0 and summary["to_do"] == 0 and summary["written"] == 0
    assert verify(out)["problems"] == [] and verify(out)["checked"] == ROWS - 1


def test_user_errors_are_one_line_with_exit_2(runs, tmp_path):
    r = export(runs["speculators"], "--format", "specforge-eagle3", "--out", str(tmp_path / "x"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "cannot export to specforge-eagle3" in r.stderr and "post-norm" in r.stderr
    # a layer the target needs and the source does not hold: hs[L] final-normed for DFlash's last slot
    r = export(runs["speculators"], "--format", "specforge-dflash", "--out", str(tmp_path / "d"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "reads hs[8] (target layer id 7) final-normed" in r.stderr and "pre-norm" in r.stderr
    # hs[L] post-norm into the speculators layout, whose trainer norms it again
    r = export(runs["specforge-eagle3"], "--format", "speculators", "--out", str(tmp_path / "s"))
    assert r.returncode == 2 and "normed twice" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = export(str(tmp_path / "nothing"), "--format", "eagle", "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "no meta.json" in r.stderr and "Traceback" not in r.stderr
    r = export(runs["speculators"], "--format", "speculators", "--out", runs["speculators"])
    assert r.returncode == 2 and "another folder" in r.stderr


def test_a_damaged_source_file_is_reported_and_the_rest_converted(runs, tmp_path):
    import shutil
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    shutil.copytree(runs["speculators"], src)
    with open(os.path.join(src, "hs_4.safetensors"), "r+b") as f:
        f.truncate(100)
    r = export(src, "--format", "speculators", "--out", out)
    assert r.returncode == 1 and "problem: sample 4:" in r.stderr
    assert sorted(samples(out)) == [i for i in range(ROWS) if i not in (UNSUPERVISED, 4)]


def test_an_export_never_mixes_into_a_run_or_writes_over_its_own_source(runs, tmp_path):
    """--out another run's output (same format and layers: it used to pass, rewriting that run's
    meta.json over 199 files of another model), a link to the source itself, a folder inside it:
    each refused in one line, and nothing there changed."""
    import shutil
    src = runs["specforge-dflash"]                               # (a pair the layers allow: see above)
    other = str(tmp_path / "other")
    shutil.copytree(runs["speculators"], other)
    before = open(os.path.join(other, "meta.json")).read()
    link = tmp_path / "link"
    link.symlink_to(src)
    for out, says in ((other, "holds a run's output (its meta.json is no export's)"),
                      (str(link), f"is the output it would export ({src})"),
                      (os.path.join(src, "sub"), "is inside the output it would export")):
        r = export(src, "--format", "speculators", "--out", out)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert open(os.path.join(other, "meta.json")).read() == before
    assert not os.path.exists(os.path.join(src, "sub", "meta.json"))
