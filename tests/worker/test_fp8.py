"""fp8 hidden states, written by the real worker on the tiny model and read back by our loader and by
speculators' own FP8 reader (hs_connectors' FP8Transfer, installed by scripts/test.sh): the same
tensors, within fp8's error bound per layer, one scale per token per layer so that a layer 1000x
larger leaves its neighbours alone; resume, verify (a truncated file too), repair, export, and the
refusals that keep bf16 and fp8 apart."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from worker import fp8
from worker.formats import load_sample
from worker.verify import verify

from tests.conftest import REPO, read_events, run_worker, wait_for
from tests.worker.conftest import H, MAX_LEN, ROWS, UNSUPERVISED

hs_connectors = pytest.importorskip("hs_connectors")
from hs_connectors import FP8Transfer  # noqa: E402
from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8  # noqa: E402

FP8_BOUND = 2.0 ** -4          # e4m3's largest relative rounding error above its subnormal range


def written(rows) -> list[int]:
    return [i for i in range(rows) if i != UNSUPERVISED]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def layer_errors(got: torch.Tensor, ref: torch.Tensor) -> list[tuple[float, float]]:
    """Per layer of [T, n, H]: relative error and the minimum per-token cosine."""
    out = []
    for l in range(ref.shape[1]):
        a, b = got[:, l].float(), ref[:, l].float()
        out.append((rel_err(a, b), float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())))
    return out


def element_error(got: torch.Tensor, ref: torch.Tensor, floor: float = 0.05) -> float:
    """Largest relative error of the elements that are at least `floor` of their row's amax in
    their own layer (the ones a layer's own scale keeps in fp8's normal range)."""
    a, b = got.float(), ref.float()
    big = b.abs() >= floor * b.abs().amax(-1, keepdim=True)
    return float(((a - b).abs() / b.abs())[big].max())


def flushed(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of non-zero elements that came back as 0."""
    return float(((got == 0) & (ref != 0)).float().mean())


def worker(model: str, data: str, out: str, *extra: str, state: str | None = None):
    args = ["--model", model, "--data", data, "--out", out, "--model-dtype", "fp32",
            "--max-tokens-per-batch", "512", "--max-skip-fraction", "0.5", *extra]
    return run_worker(*args, *(["--state", state] if state else []))


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, dense_model, prepared) -> str:
    out = str(tmp_path_factory.mktemp("fp8") / "out")
    r = worker(dense_model, prepared[0], out, "--dtype", "fp8")
    assert r.returncode == 0, r.stderr
    return out


# --- the files and their readers --------------------------------------------------------------

def test_fp8_files_are_what_the_gpu_quantised_and_both_readers_dequantise_them_alike(fp8_run, runs, prepared):
    meta = json.load(open(os.path.join(fp8_run, "meta.json")))
    assert meta["dtype"] == "float8_e4m3fn" and meta["identity"]["dtype"] == "fp8"
    assert meta["hidden_states_scales"]["layout"] == "per-token-per-layer"
    assert meta["hidden_states_scales"]["shape"] == "[T, n_layers, 1]"
    bf16_run = runs["speculators"]               # the same model, data and layers, stored in bf16
    theirs = FP8Transfer(Path(fp8_run))           # what `speculators train --hidden-states-backend fp8` reads through
    rows = prepared[1]
    for i in written(ROWS):
        path = os.path.join(fp8_run, f"hs_{i}.safetensors")
        raw = load_file(path)
        with safe_open(path, framework="pt") as f:
            header = f.metadata()
        T = len(rows[i]["input_ids"])
        assert raw["hidden_states"].dtype == torch.float8_e4m3fn and raw["hidden_states"].shape == (T, 4, H)
        assert raw[fp8.SCALES_KEY].dtype == torch.float32 and raw[fp8.SCALES_KEY].shape == (T, 4, 1)
        assert (header["dtype"], header["scale_layout"], header["sample_index"]) == \
            ("float8_e4m3fn", "per-token-per-layer", str(i))
        # Quantised from exactly the states the bf16 run stored: same bytes as quantising its file.
        reference = load_file(os.path.join(bf16_run, f"hs_{i}.safetensors"))["hidden_states"]
        values, scales = fp8.quantize(reference)
        assert torch.equal(raw["hidden_states"].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(raw[fp8.SCALES_KEY], scales)
        # Our loader and speculators' reader: the same bf16 tensor, scales gone, ids untouched.
        ours, spec = load_sample(path), theirs.get_cached(i)
        assert fp8.SCALES_KEY not in ours and fp8.SCALES_KEY not in spec
        assert ours["hidden_states"].dtype == spec["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(ours["hidden_states"], spec["hidden_states"])
        assert ours["token_ids"].tolist() == spec["token_ids"].tolist() == rows[i]["input_ids"]
        # Exact: an fp8 value times a power of two, whatever dtype the reader multiplies in.
        assert torch.equal(ours["hidden_states"].float(), raw["hidden_states"].float() * raw[fp8.SCALES_KEY])
        for rel, cos in layer_errors(ours["hidden_states"], reference):
            assert rel < 0.04 and cos > 0.998, (i, rel, cos)
        assert element_error(ours["hidden_states"], reference) <= FP8_BOUND
    assert not os.path.exists(os.path.join(fp8_run, f"hs_{UNSUPERVISED}.safetensors"))
    assert verify(fp8_run)["problems"] == [] and verify(fp8_run)["dtype"] == "fp8"


def test_speculators_trains_on_fp8_files_through_its_fp8_backend(fp8_run, prepared):
    data = pytest.importorskip("speculators.train.data")
    from hs_connectors.transfer import HiddenStatesBackend
    assert HiddenStatesBackend.registry["fp8"].from_train_args(
        type("Args", (), {"hidden_states_path": fp8_run})(), prepared[0]).hidden_states_path == Path(fp8_run)
    ds = data.ArrowDataset(max_len=MAX_LEN, datapath=prepared[0], transfer=FP8Transfer(Path(fp8_run)),
                           on_missing="skip")
    rows = prepared[1]
    items = []
    for i in written(ROWS):
        item = ds[i]
        states = load_sample(os.path.join(fp8_run, f"hs_{i}.safetensors"))["hidden_states"]
        assert item["input_ids"].tolist() == rows[i]["input_ids"]
        assert torch.equal(item["hidden_states"], states[:, :-1].flatten(1))      # drafter input
        assert torch.equal(item["verifier_last_hidden_states"], states[:, -1])   # verifier state
        items.append(item)
    batch = data.CollateFn(MAX_LEN, H, num_target_layers=3)(items)
    assert batch["hidden_states"].shape == (1, MAX_LEN, 3 * H) and batch["hidden_states"].dtype == torch.bfloat16


def test_a_file_from_speculators_own_fp8_writer_reads_the_same_through_our_loader(tmp_path):
    torch.manual_seed(0)
    hidden = torch.randn(9, 4, H, dtype=torch.bfloat16)
    values, scales = quantize_tensor_to_fp8(hidden)          # its writer: [T, 1, 1] fp32 scales
    ours_q, ours_s = fp8.speculators_quantize(hidden)        # our copy of it, for the benchmark
    assert torch.equal(values.view(torch.uint8), ours_q.view(torch.uint8)) and torch.equal(scales, ours_s)
    save_file({"hidden_states": values, fp8.SCALES_KEY: scales, "token_ids": torch.arange(9)},
              str(tmp_path / "hs_0.safetensors"))
    ours = load_sample(str(tmp_path / "hs_0.safetensors"))
    assert torch.equal(ours["hidden_states"], FP8Transfer(tmp_path).get_cached(0)["hidden_states"])


# --- precision ---------------------------------------------------------------------------------

def test_quantisation_bounds_zero_rows_and_round_trips():
    torch.manual_seed(1)
    # Rows of every magnitude from 1e-8 to 1e8, and a row of zeros.
    x = torch.randn(256, 4, 512) * 10.0 ** torch.randint(-8, 9, (256, 4, 1)).float()
    x[5] = 0
    x = x.to(torch.bfloat16)
    values, scales = fp8.quantize(x)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (256, 4, 1) and scales.dtype == torch.float32
    back = fp8.dequantize(values, scales)
    assert torch.equal(back[5], torch.zeros_like(back[5])) and torch.equal(scales[5], torch.ones(4, 1))
    # Every element: at most fp8's relative rounding (normal range) or half its subnormal step.
    err = (back.float() - x.float()).abs()
    assert bool((err <= torch.maximum(FP8_BOUND * x.float().abs(), scales * 2.0 ** -10)).all())
    for l in range(4):
        assert rel_err(back[:, l], x[:, l]) < 0.04
    # Powers of two: the row's amax lands in (232, 464], dequantising is exact in bf16 as in fp32,
    # quantising fp32 gives the same bytes, re-quantising the dequantised gives the same bytes.
    ratio = x.float().abs().amax(-1, keepdim=True) / scales
    assert bool(((ratio > 232) & (ratio <= 464) | (ratio == 0)).all())
    assert torch.equal(torch.log2(scales), torch.log2(scales).round())
    assert torch.equal(back, dequantize_fp8_tensor(values, scales))
    assert torch.equal(back.float(), values.float() * scales)
    v32, s32 = fp8.quantize(x.float())
    assert torch.equal(v32.view(torch.uint8), values.view(torch.uint8)) and torch.equal(s32, scales)
    v2, s2 = fp8.quantize(back)
    assert torch.equal(v2.view(torch.uint8), values.view(torch.uint8)) and torch.equal(s2, scales)
    inplace = x.clone()
    v3, _ = fp8.quantize(inplace, inplace=True)
    assert torch.equal(v3.view(torch.uint8), values.view(torch.uint8))


def test_a_layer_scaled_1000x_leaves_its_neighbours_alone_with_per_layer_scales(runs):
    """Real states of the tiny model, the raw last layer (slot 3) scaled x1000 then x100000."""
    states = torch.cat([load_file(p)["hidden_states"] for p in sorted(glob.glob(
        os.path.join(runs["speculators"], "hs_*.safetensors")))])
    plain_values, plain_scales = fp8.quantize(states)
    for factor in (1e3, 1e5):
        x = states.clone()
        x[:, 3] *= factor
        values, scales = fp8.quantize(x)
        # Per layer: the neighbours' bytes are the ones they get without the big layer.
        assert torch.equal(values[:, :3].view(torch.uint8), plain_values[:, :3].view(torch.uint8))
        assert torch.equal(scales[:, :3], plain_scales[:, :3])
        ours = fp8.dequantize(values, scales)
        per_token = dequantize_fp8_tensor(*quantize_tensor_to_fp8(x))        # speculators' writer
        for l in range(3):
            assert element_error(ours[:, l], x[:, l]) <= FP8_BOUND and flushed(ours[:, l], x[:, l]) < 2e-4
            # Per token: the big layer sets every token's scale; its neighbours fall towards fp8's
            # subnormals. At x1000 elements that matter in their own layer lose more than fp8's
            # own bound (up to 13%) and 0.5-1% of all are flushed to zero, though the layer's
            # overall error hardly moves yet; at x100000 the layer is lost (45-66%).
            assert element_error(per_token[:, l], x[:, l]) > 1.2 * FP8_BOUND
            assert flushed(per_token[:, l], x[:, l]) > 0.003
        if factor == 1e5:
            assert min(rel_err(per_token[:, l], x[:, l]) for l in range(3)) > 0.3
            assert max(rel_err(ours[:, l], x[:, l]) for l in range(3)) < 0.04


def test_an_outlier_last_layer_in_the_model_changes_no_byte_of_the_other_layers(tmp_path, dense_model, prepared):
    """Through the real worker: the model's last decoder layer writes states over 1000x larger than
    the others (its mlp.down_proj scaled x100000): hs[2], hs[4], hs[5] come from the layers before
    it, and their fp8 bytes are those of the unmodified model, where speculators' per-token scales
    would lose precision on them."""
    loud = str(tmp_path / "loud")
    shutil.copytree(dense_model, loud)
    weights = load_file(os.path.join(loud, "model.safetensors"))
    weights["model.layers.7.mlp.down_proj.weight"] *= 1e5
    save_file(weights, os.path.join(loud, "model.safetensors"), metadata={"format": "pt"})
    outs = {}
    for name, model, dtype in (("plain", dense_model, "fp8"), ("loud", loud, "fp8"), ("loud-bf16", loud, "bf16")):
        outs[name] = str(tmp_path / name)
        r = worker(model, prepared[0], outs[name], "--dtype", dtype)
        assert r.returncode == 0, r.stderr
    for i in written(ROWS):
        plain, loud_file = (load_file(os.path.join(outs[k], f"hs_{i}.safetensors")) for k in ("plain", "loud"))
        assert torch.equal(plain["hidden_states"][:, :3].view(torch.uint8), loud_file["hidden_states"][:, :3].view(torch.uint8))
        assert torch.equal(plain[fp8.SCALES_KEY][:, :3], loud_file[fp8.SCALES_KEY][:, :3])
        reference = load_file(os.path.join(outs["loud-bf16"], f"hs_{i}.safetensors"))["hidden_states"]
        assert float(reference[:, 3].float().abs().max()) > 1000 * float(reference[:, :3].float().abs().max())
        ours = load_sample(os.path.join(outs["loud"], f"hs_{i}.safetensors"))["hidden_states"]
        assert all(rel < 0.04 for rel, _ in layer_errors(ours, reference))
        assert element_error(ours, reference) <= FP8_BOUND
        per_token = dequantize_fp8_tensor(*quantize_tensor_to_fp8(reference))
        assert max(element_error(per_token[:, l], reference[:, l]) for l in range(3)) > FP8_BOUND


# --- resume, verify, repair, export, refusals ----------------------------------------------------

def manifest_indices(out: str) -> list[int]:
    return [json.loads(l)["index"] for p in glob.glob(os.path.join(out, "manifest", "*.jsonl"))
            for l in open(p) if l.strip()]


def test_fp8_resume_after_sigkill_verify_a_truncated_file_and_repair(tmp_path, dense_model):
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 1200, vocab_size=500, mean_tokens=60, seed=8)
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    args = [sys.executable, "-m", "worker.extract", "--model", dense_model, "--data", data, "--out", out,
            "--state", state, "--max-tokens-per-batch", "256", "--dtype", "fp8"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(manifest_indices(out)) >= 100, 120, what="some fp8 samples written")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    before = set(manifest_indices(out))
    assert 0 < len(before) < 1200, "kill landed mid-run"
    assert verify(out)["problems"] == []                        # what was finished is sound
    r = run_worker("--model", dense_model, "--data", data, "--out", out, "--state", state,
                   "--max-tokens-per-batch", "256", "--dtype", "fp8")
    assert r.returncode == 0, r.stderr
    assert sorted(manifest_indices(out)) == list(range(1200))    # nothing lost, nothing twice
    done = [e for e in read_events(state) if e["event"] == "done"][-1]
    assert done["done"] == 1200 and done["bytes"] == sum(
        os.path.getsize(p) for p in glob.glob(os.path.join(out, "hs_*.safetensors")))
    report = verify(out)
    assert report["problems"] == [] and report["dtype"] == "fp8" and report["written"] == [[0, 1200]]
    # A truncated file, a file whose scales were zeroed, a bf16 file among fp8 ones.
    cut, zeroed, wrong = (os.path.join(out, f"hs_{i}.safetensors") for i in (3, 4, 5))
    with open(cut, "r+b") as f:
        f.truncate(os.path.getsize(cut) // 2)
    tensors = load_file(zeroed)
    tensors[fp8.SCALES_KEY][0, 1] = 0
    save_file(tensors, zeroed, metadata=safe_open(zeroed, framework="pt").metadata())
    tensors = load_sample(wrong)
    save_file(tensors, wrong, metadata=safe_open(wrong, framework="pt").metadata())
    problems = verify(out)["problems"]
    assert len(problems) == 3, problems
    assert any(p.startswith(f"sample 3: {cut} unreadable") for p in problems)
    assert any(p.startswith("sample 4:") and "not a positive finite number" in p for p in problems)
    assert any(p.startswith("sample 5:") and "expected torch.float8_e4m3fn" in p for p in problems)
    repaired = verify(out, repair=True)
    assert repaired["repaired"]["dropped"] == [3, 4, 5] and repaired["problems"] == []
    r = run_worker("--model", dense_model, "--data", data, "--out", out, "--state", state,
                   "--max-tokens-per-batch", "256", "--dtype", "fp8")
    assert r.returncode == 0, r.stderr
    assert verify(out)["problems"] == [] and sorted(manifest_indices(out)) == list(range(1200))


def test_bf16_and_fp8_never_share_an_output(tmp_path, runs, dense_model, prepared):
    out = str(tmp_path / "bf16")
    shutil.copytree(runs["speculators"], out)
    meta = open(os.path.join(out, "meta.json")).read()
    state = str(tmp_path / "state")
    r = worker(dense_model, prepared[0], out, "--dtype", "fp8", state=state)
    assert r.returncode == 1 and "holds another run's work" in r.stderr and "dtype: bf16 -> fp8" in r.stderr
    assert [e for e in read_events(state) if e["event"] == "failed"][-1]["fatal"] is True
    assert open(os.path.join(out, "meta.json")).read() == meta
    # A meta.json from before fp8 existed (no dtype anywhere) holds bf16 files.
    old = json.loads(meta)
    old.pop("dtype")
    old["identity"].pop("dtype")
    Path(out, "meta.json").write_text(json.dumps(old))
    r = worker(dense_model, prepared[0], out, "--dtype", "fp8")
    assert r.returncode == 1 and "dtype: bf16 -> fp8" in r.stderr
    assert worker(dense_model, prepared[0], out).returncode == 0       # bf16 carries on
    assert verify(out)["problems"] == []


@pytest.mark.parametrize("fmt, reader", [("specforge-eagle3", "SpecForge's load_feature_file"),
                                         ("specforge-dflash", "SpecForge's load_feature_file"),
                                         ("eagle", "EAGLE-1/2's torch.load")])
def test_fp8_is_refused_where_the_trainer_cannot_dequantise(tmp_path, dense_model, prepared, fmt, reader):
    out = str(tmp_path / "out")
    r = worker(dense_model, prepared[0], out, "--format", fmt, "--dtype", "fp8")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(line) == 1 and reader in line[0] and "cannot dequantise fp8" in line[0]
    assert not os.path.exists(os.path.join(out, "meta.json"))


def test_the_old_dtype_flag_still_sets_the_model_dtype(tmp_path, dense_model, prepared):
    out = str(tmp_path / "out")
    r = run_worker("--model", dense_model, "--data", prepared[0], "--out", out, "--dtype", "fp32",
                   "--max-skip-fraction", "0.5")
    assert r.returncode == 0 and "--dtype fp32 means --model-dtype fp32" in r.stderr
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert (meta["model_dtype"], meta["dtype"]) == ("float32", "bfloat16")


def test_export_keeps_fp8_where_the_reader_dequantises_and_writes_bf16_where_it_cannot(tmp_path):
    """fp8 -> speculators: the same bytes; fp8 -> a SpecForge or EAGLE layout (which cannot read
    fp8, so extraction refuses it): bf16, exactly the values speculators' reader sees."""
    from worker.demo import make_model
    from worker.export import export
    model = make_model(str(tmp_path / "m"), layers=8)
    rows = [{"input_ids": list(range(5 + i, 25 + 2 * i)), "loss_mask": [1] * (20 + i)} for i in range(6)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    src = str(tmp_path / "src")
    r = worker(model, str(data), src, "--dtype", "fp8", "--layers", "2,4,5")    # no hs[L]: DFlash reads them
    assert r.returncode == 0, r.stderr
    same = export(src, "speculators", str(tmp_path / "same"))
    assert same.dtype == "fp8" and same.written == 6 and not same.problems
    for i in range(6):
        a, b = (load_file(os.path.join(d, f"hs_{i}.safetensors")) for d in (src, str(tmp_path / "same")))
        assert torch.equal(a["hidden_states"].view(torch.uint8), b["hidden_states"].view(torch.uint8))
        assert torch.equal(a[fp8.SCALES_KEY], b[fp8.SCALES_KEY])
    assert verify(str(tmp_path / "same"))["problems"] == []
    sf = export(src, "specforge-dflash", str(tmp_path / "sf"))
    assert sf.dtype == "bf16" and sf.written == 6
    meta = json.load(open(tmp_path / "sf" / "meta.json"))
    assert meta["dtype"] == "bfloat16" and "hidden_states_scales" not in meta and meta["identity"]["dtype"] == "bf16"
    for i in range(6):
        states = load_sample(os.path.join(src, f"hs_{i}.safetensors"))["hidden_states"]
        ckpt = load_sample(str(next((tmp_path / "sf").rglob(f"data_{i}.ckpt"))))
        assert torch.equal(ckpt["hidden_states"][0], states.reshape(len(states), -1))
    assert verify(str(tmp_path / "sf"))["problems"] == []
