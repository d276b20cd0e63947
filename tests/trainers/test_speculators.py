"""speculators' own `train` runs two steps on the worker's output of a raw chat dataset (the demo's
set-up): every written sample is used (its prepared dataset, `<out>/prepared`, is written from the
worker's own tokenization, so no row is "unavailable"), each has supervised tokens, the loss is
finite. bf16 and fp8 (read through speculators' FP8 backend, the flag meta.json names)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_worker

pytest.importorskip("speculators.train.cli")
ROWS, BAD = 9, 4                         # row BAD is an empty conversation: recorded as skipped


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> str:
    from worker.demo import make_chat_dataset
    path = make_chat_dataset(str(tmp_path_factory.mktemp("chats") / "chat.jsonl"), ROWS, mean_words=24)
    lines = open(path).read().splitlines()
    lines[BAD] = json.dumps({"conversations": []})
    open(path, "w").write("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def outs(tmp_path_factory, dense_model, chats) -> dict[str, str]:
    out = {}
    for dtype in ("bf16", "fp8"):
        folder = str(tmp_path_factory.mktemp(dtype) / "out")
        r = run_worker("--model", dense_model, "--data", chats, "--out", folder, "--format", "speculators",
                       "--dtype", dtype, "--max-skip-fraction", "0.5")
        assert r.returncode == 0, r.stderr
        out[dtype] = folder
    return out


def test_prepared_dataset_is_what_speculators_arrow_dataset_checks(outs):
    from speculators.train.data import ArrowDataset
    meta = json.load(open(os.path.join(outs["bf16"], "meta.json")))
    ds = ArrowDataset(max_len=4096, datapath=os.path.join(outs["bf16"], "prepared"), on_missing="raise")
    assert len(ds) == ROWS - 1                       # dense: the skipped row has no row
    for k in range(len(ds)):
        item = ds[k]                                 # raises on a missing file, drops a mismatch
        assert isinstance(item, dict) and item["loss_mask"].sum() > 0
    # row k is the k-th written sample: the row after the skipped one is hs_<BAD + 1>
    from safetensors.torch import load_file
    assert ds[BAD]["input_ids"].tolist() == load_file(os.path.join(outs["bf16"], f"hs_{BAD + 1}.safetensors"))["token_ids"].tolist()
    assert meta["trainer_setting"].startswith("--target-layer-ids 2 4 5")


def test_verify_prints_the_command_and_flags_what_speculators_would_miss(outs, dense_model, tmp_path):
    import shutil
    from worker.verify import verify
    for dtype, out in outs.items():
        rep = verify(out)
        assert rep["problems"] == []
        fp8 = " --hidden-states-backend fp8" if dtype == "fp8" else ""
        assert rep["command"] == (f"speculators train --speculator-type eagle3 --verifier-name-or-path "
                                  f"{dense_model} --data-path {out}/prepared --target-layer-ids 2 4 5{fp8}")
    copy = str(tmp_path / "copy")
    shutil.copytree(outs["bf16"], copy, symlinks=True)
    os.unlink(os.path.join(copy, "prepared", "hidden_states", "hs_0.safetensors"))
    open(os.path.join(copy, ".tmp-hs_3.safetensors-1a2b"), "w").close()      # an interrupted write
    notes = verify(copy)["notes"]
    assert any("prepared holds 7 rows, the manifests 8 written samples" in n for n in notes)
    assert any(".tmp-hs_3.safetensors-1a2b: left by an interrupted write or export" in n for n in notes)
    from worker.prepared import main as rewrite
    assert rewrite([copy]) == 0 and not any("prepared" in n for n in verify(copy)["notes"])


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["eagle3", "dflash"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_speculators_trains_on_every_sample(outs, dense_model, tmp_path, algo, dtype):
    out = outs[dtype]
    import shlex
    from worker.verify import verify
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert ("--hidden-states-backend fp8" in meta["trainer_setting"]) == (dtype == "fp8")
    flags = shlex.split(verify(out)["command"])[2:]          # the command verify prints, as it is
    flags[flags.index("--speculator-type") + 1] = algo
    r = subprocess.run([sys.executable, "-m", "tests.trainers.run_speculators", *flags,
                        "--save-path", str(tmp_path / "ckpt"),
                        "--epochs", "2", "--total-seq-len", "1024", "--num-workers", "0",
                        "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
                        "--no-resume-from-checkpoint"],
                       cwd=REPO, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["unavailable"] == []
    assert sorted(map(int, got["loaded"])) == list(range(ROWS - 1))     # train + validation split
    assert all(n > 0 for n in got["loaded"].values())
    assert len(got["losses"]) >= 2 and all(math.isfinite(x) for x in got["losses"])
