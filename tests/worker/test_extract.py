"""The worker end to end on the CPU: files, batching, sharding, resume after SIGKILL, bad rows."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from worker.data import shard_range
from worker.verify import verify
from tests.conftest import REPO, read_events, run_worker, wait_for


def load_sample(out: str, i: int) -> tuple[dict, dict]:
    path = os.path.join(out, f"hs_{i}.safetensors")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    return load_file(path), meta


def manifest_indices(out: str) -> list[int]:
    return [json.loads(l)["index"] for p in glob.glob(os.path.join(out, "manifest", "*.jsonl"))
            for l in open(p) if l.strip()]


@pytest.mark.parametrize("n", [0, 1, 5, 17, 100])
def test_shards_cover_every_index_exactly_once(n):
    for shards in range(1, 9):
        seen = []
        for k in range(shards):
            a, b = shard_range(n, shards, k)
            seen += range(a, b)
        assert seen == list(range(n))


def test_files_manifest_meta_and_no_padding(tmp_path, dense_model, token_data):
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = run_worker("--model", dense_model, "--data", token_data, "--out", out, "--state", state,
                   "--max-tokens-per-batch", "512", "--model-dtype", "fp32", "--progress-interval", "0.05")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in open(token_data)]
    assert sorted(manifest_indices(out)) == list(range(len(rows)))
    # Issue 55: the log says what changed; heartbeats (progress with the same counters) go to
    # events.jsonl only. Each progress line's counters differ from the previous line's.
    printed = [l.split(" progress ", 1)[1] for l in r.stdout.splitlines() if " progress " in l]
    counters = [tuple(f for f in line.split() if f.split("=")[0] in ("done", "skipped", "total", "tokens"))
                for line in printed]
    assert printed and all(a != b for a, b in zip(counters, counters[1:])), printed
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["layer_ids"] == [2, 4, 5, 8] and meta["last_layer_norm"] == "pre"
    assert meta["num_samples"] == len(rows) and meta["hidden_size"] == 64
    for i in (0, 7, len(rows) - 1):
        tensors, fmeta = load_sample(out, i)
        T = len(rows[i]["input_ids"])
        assert tensors["hidden_states"].dtype == torch.bfloat16
        assert tuple(tensors["hidden_states"].shape) == (T, 4, 64)       # padding stripped
        assert tensors["token_ids"].tolist() == rows[i]["input_ids"]
        assert tensors["loss_mask"].tolist() == rows[i]["loss_mask"]
        assert fmeta["sample_index"] == str(i) and fmeta["layer_ids"] == "2,4,5,8"
        assert fmeta["last_layer_norm"] == "pre"
    kinds = [e["event"] for e in read_events(state)]
    assert kinds[0] == "started" and kinds[-1] == "done"
    assert {"loading", "loaded", "progress"} <= set(kinds)
    assert verify(out)["problems"] == []


def test_a_cpu_without_native_bf16_computes_in_fp32_and_stores_bf16(tmp_path, dense_model, token_data):
    """torch and oneDNN held to AVX2 (no bf16 instructions, as on the AMD EPYC of issue 39): the
    worker left to choose computes in fp32, says so in its path line, and writes exactly what an
    explicit --model-dtype fp32 run writes; bf16 asked for is kept."""
    avx2 = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"}
    runs = {}
    for name, extra in (("chosen", ()), ("fp32", ("--model-dtype", "fp32")), ("bf16", ("--model-dtype", "bf16"))):
        out, state = str(tmp_path / name), str(tmp_path / f"{name}-state")
        r = run_worker("--model", dense_model, "--data", token_data, "--out", out, "--state", state,
                       "--max-tokens-per-batch", "512", *extra, env=avx2)
        assert r.returncode == 0, r.stderr
        loaded = next(e for e in read_events(state) if e["event"] == "loaded")
        runs[name] = (out, loaded["path"], json.load(open(os.path.join(out, "meta.json"))))
    out, path, meta = runs["chosen"]
    assert "computing in fp32: this CPU has no native bf16" in path and "stored as asked" in path
    assert (meta["model_dtype"], meta["dtype"]) == ("float32", "bfloat16")
    assert "computing in fp32" not in runs["fp32"][1] and "computing in fp32" not in runs["bf16"][1]
    assert runs["bf16"][2]["model_dtype"] == "bfloat16"
    for i in (0, 9, 31):
        chosen = load_sample(out, i)[0]["hidden_states"]
        assert chosen.dtype == torch.bfloat16
        assert torch.equal(chosen, load_sample(runs["fp32"][0], i)[0]["hidden_states"])


def test_batched_equals_one_at_a_time(tmp_path, models, token_data):
    for arch in ("qwen3", "qwen3_5_text"):
        outs = {}
        for budget in ("4096", "1"):               # budget 1: every sample its own batch
            out = str(tmp_path / f"{arch}-{budget}")
            r = run_worker("--model", models[arch], "--data", token_data, "--out", out,
                           "--max-tokens-per-batch", budget, "--model-dtype", "fp32")
            assert r.returncode == 0, r.stderr
            outs[budget] = out
        for i in range(0, 60, 7):
            a = load_sample(outs["4096"], i)[0]["hidden_states"].float()
            b = load_sample(outs["1"], i)[0]["hidden_states"].float()
            assert a.shape == b.shape
            assert float((a - b).norm() / b.norm()) < 1e-2, (arch, i)


def test_sharded_runs_cover_the_dataset_and_resume_across_shard_counts(tmp_path, dense_model, token_data):
    out = str(tmp_path / "out")
    for k in range(3):
        assert run_worker("--model", dense_model, "--data", token_data, "--out", out,
                          "--num-shards", "3", "--shard-index", str(k)).returncode == 0
    written = sorted(manifest_indices(out))
    assert written == list(range(60))
    # A second run with another shard count finds everything done and writes nothing twice.
    state = str(tmp_path / "st")
    r = run_worker("--model", dense_model, "--data", token_data, "--out", out, "--state", state,
                   "--num-shards", "2", "--shard-index", "1")
    assert r.returncode == 0
    assert sorted(manifest_indices(out)) == written
    done = [e for e in read_events(state) if e["event"] == "done"][0]
    assert done["done"] == 30


def test_sigkill_mid_run_then_resume_ends_complete(tmp_path, dense_model):
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "big.jsonl"), 1500, vocab_size=500, mean_tokens=60, seed=5)
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    args = [sys.executable, "-m", "worker.extract", "--model", dense_model, "--data", data, "--out", out,
            "--state", state, "--max-tokens-per-batch", "256"]
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(manifest_indices(out)) >= 100, 120, what="some samples written")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    before = set(manifest_indices(out))
    assert 0 < len(before) < 1500, "kill landed mid-run"
    assert not [p for p in glob.glob(os.path.join(out, "hs_*.safetensors")) if ".tmp" in p]
    r = run_worker("--model", dense_model, "--data", data, "--out", out, "--state", state,
                   "--max-tokens-per-batch", "256")
    assert r.returncode == 0, r.stderr
    indices = manifest_indices(out)
    assert sorted(indices) == list(range(1500))            # complete, and no sample twice
    report = verify(out)
    assert report["problems"] == [] and report["written"] == [[0, 1500]]


def test_malformed_rows_are_skipped_and_reported(tmp_path, dense_model):
    data = tmp_path / "bad.jsonl"
    good = json.dumps({"input_ids": [1, 2, 3, 4]})
    lines = [good.encode(),
             b'{"input_ids": [1, 2,',                                 # broken JSON
             b'\xff\xfe not utf-8',
             json.dumps({"text": "no ids"}).encode(),
             json.dumps({"input_ids": [1, 99999]}).encode(),          # beyond the vocabulary
             json.dumps({"input_ids": [1, 2], "loss_mask": [1]}).encode(),
             json.dumps({"input_ids": "abc"}).encode(),
             b"",
             json.dumps({"conversations": [{"from": "alien", "value": "x"}]}).encode(),
             good.encode()]
    data.write_bytes(b"\n".join(lines) + b"\n")
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = run_worker("--max-skip-fraction", "1", "--model", dense_model, "--data", str(data), "--out", out, "--state", state)
    assert r.returncode == 0, r.stderr
    skipped = {e["index"]: e["reason"] for e in read_events(state) if e["event"] == "sample_skipped"}
    assert set(skipped) == {1, 2, 3, 4, 5, 6, 7, 8}
    assert "not valid JSON" in skipped[1] and "not UTF-8" in skipped[2]
    assert "none of input_ids" in skipped[3] and "out of range for vocab" in skipped[4]
    assert "loss_mask length" in skipped[5] and "not a list of integers" in skipped[6]
    assert "empty line" in skipped[7] and "unknown role" in skipped[8]
    assert sorted(i for i in manifest_indices(out)) == list(range(10))   # skips are recorded too
    assert os.path.exists(os.path.join(out, "hs_0.safetensors"))
    assert os.path.exists(os.path.join(out, "hs_9.safetensors"))
    rep = verify(out)
    assert rep["problems"] == [] and len(rep["skipped"]) == 8


@pytest.mark.parametrize("mode", ["skip", "truncate"])
def test_too_long_samples(tmp_path, dense_model, token_data, mode):
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = run_worker("--max-skip-fraction", "1", "--model", dense_model, "--data", token_data, "--out", out, "--state", state,
                   "--max-length", "30", "--too-long", mode)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(l) for l in open(token_data)]
    long_ones = [i for i, row in enumerate(rows) if len(row["input_ids"]) > 30]
    assert long_ones
    reasons = {e["index"]: e["reason"] for e in read_events(state) if e["event"] == "sample_skipped"}
    if mode == "skip":
        assert set(reasons) == set(long_ones)
        assert not os.path.exists(os.path.join(out, f"hs_{long_ones[0]}.safetensors"))
    else:
        # Cut to 30 tokens, a sample whose supervised part started later teaches nothing: skipped.
        unsupervised = {i for i in long_ones if not any(rows[i]["loss_mask"][:30])}
        assert unsupervised and set(reasons) == unsupervised
        assert all(r == "no supervised token (loss_mask is all 0)" for r in reasons.values())
        kept = next(i for i in long_ones if i not in unsupervised)
        t, _ = load_sample(out, kept)
        assert t["hidden_states"].shape[0] == 30 and t["token_ids"].tolist() == rows[kept]["input_ids"][:30]


@pytest.mark.parametrize("form", ["sharegpt", "openai"])
def test_raw_chats_assistant_content_mask(tmp_path, dense_model, form):
    """--loss-mask assistant-content: the message text only (the mask before modes existed)."""
    from transformers import AutoTokenizer
    data = tmp_path / "chat.jsonl"
    user, assistant = "please explain the hidden state", "the model writes each layer to disk"
    if form == "sharegpt":
        row = {"conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]}
    else:
        row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}
    data.write_text(json.dumps(row) + "\n")
    out = str(tmp_path / "out")
    assert run_worker("--model", dense_model, "--data", str(data), "--out", out,
                      "--loss-mask", "assistant-content").returncode == 0
    t, _ = load_sample(out, 0)
    tok = AutoTokenizer.from_pretrained(dense_model)
    ids, mask = t["token_ids"].tolist(), t["loss_mask"].tolist()
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert masked.strip() == assistant
    assert user in unmasked and "assistant" in unmasked and assistant not in unmasked


def test_parquet_and_save_to_disk_inputs(tmp_path, dense_model, token_data):
    import datasets
    rows = [json.loads(l) for l in open(token_data)][:12]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "arrow"))
    for src in ("d.parquet", "arrow"):
        out = str(tmp_path / f"out-{src}")
        r = run_worker("--model", dense_model, "--data", str(tmp_path / src), "--out", out)
        assert r.returncode == 0, r.stderr
        assert sorted(manifest_indices(out)) == list(range(12))
        t, _ = load_sample(out, 5)
        assert t["token_ids"].tolist() == rows[5]["input_ids"]


def test_speculators_layout_output_inside_the_dataset_folder_over_two_shards_and_a_restart(
        tmp_path, dense_model, token_data):
    """speculators keeps the hidden states in `<prepared>/hidden_states`: the files the first shard
    writes there are not the data, so the second shard and a restart see the same identity."""
    import datasets
    from worker.identity import dataset_identity
    rows = [json.loads(l) for l in open(token_data)][:12]
    data = str(tmp_path / "prepared")
    datasets.Dataset.from_list(rows).save_to_disk(data)
    before = dataset_identity(data)
    out = os.path.join(data, "hidden_states")
    common = ["--model", dense_model, "--data", data, "--out", out, "--num-shards", "2"]
    for shard in ("0", "1", "0"):                    # the last: shard 0 launched again (a restart)
        r = run_worker(*common, "--shard-index", shard)
        assert r.returncode == 0, r.stderr
    assert sorted(manifest_indices(out)) == list(range(12))
    assert {k: v for k, v in dataset_identity(data).items() if k != "mtime"} == \
        {k: v for k, v in before.items() if k != "mtime"}
    # What does change the identity: an edit of the data itself.
    with open(os.path.join(data, "dataset_info.json"), "a") as f:
        f.write(" ")
    assert dataset_identity(data)["content"] != before["content"]


def test_user_errors_are_one_line_with_exit_2(tmp_path, dense_model, token_data):
    r = run_worker("--model", str(tmp_path / "missing"), "--data", token_data, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "model folder not found" in r.stderr and "Traceback" not in r.stderr
    r = run_worker("--model", dense_model, "--data", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "no such file" in r.stderr
    r = run_worker("--model", dense_model, "--data", token_data, "--out", str(tmp_path / "o"), "--layers", "2,40")
    assert r.returncode == 2 and "out of range" in r.stderr
    r = run_worker("--model", dense_model, "--data", token_data, "--out", str(tmp_path / "o"), "--layers", "dflash")
    assert r.returncode == 2 and "ambiguous" in r.stderr and "specforge-dflash" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = run_worker("--model", dense_model, "--data", token_data, "--out", str(tmp_path / "o"),
                   "--format", "eagle", "--layers", "speculators")
    assert r.returncode == 2 and "format eagle (EAGLE-1/2) reads hs[8] post-norm only" in r.stderr
    # A folder holding other layers is refused rather than mixed.
    out = str(tmp_path / "mixed")
    assert run_worker("--model", dense_model, "--data", token_data, "--out", out, "--layers", "1,2").returncode == 0
    r = run_worker("--model", dense_model, "--data", token_data, "--out", out)
    assert r.returncode == 1 and "holds another run's work (its meta.json)" in r.stderr
    assert "layer_ids: [1, 2] -> [2, 4, 5, 8]" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_hybrid_warns_about_missing_fast_kernels(tmp_path, models, token_data):
    import importlib.util
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("flash-linear-attention is installed here")
    state = str(tmp_path / "st")
    r = run_worker("--model", models["qwen3_5_text"], "--data", token_data, "--out", str(tmp_path / "o"),
                   "--state", state)
    assert r.returncode == 0
    warnings = [e["message"] for e in read_events(state) if e["event"] == "warning"]
    assert any("flash-linear-attention" in w for w in warnings)


def test_writer_skips_non_finite_samples(tmp_path):
    """A batch whose values overflowed is not written: its non-finite row goes back to be tried
    alone; alone (the last try) it is recorded as skipped."""
    from worker.data import Sample
    from worker.writer import BackgroundWriter, Manifest, Stats, manifest_path
    out = str(tmp_path)
    skipped = []
    w = BackgroundWriter(out, Manifest(manifest_path(out, 0)), {"layer_ids": "1"}, Stats(), depth=1,
                         file_threads=2, device=torch.device("cpu"), on_skip=lambda i, r: skipped.append((i, r)))
    samples = [Sample(i, np.arange(4), np.ones(4, dtype=np.uint8)) for i in (10, 11)]
    hidden = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    hidden[1, 2, 0, 3] = float("inf")
    w.submit(samples, hidden, torch.tensor([True, False]))
    w.flush()
    assert skipped == [] and [s.index for s in w.take_retries()] == [11]
    w.submit(samples[1:], hidden[1:], torch.tensor([False]), final=True)
    w.close()
    assert skipped == [(11, "non-finite hidden states (alone, after the rest)")]
    assert os.path.exists(os.path.join(out, "hs_10.safetensors"))
    assert not os.path.exists(os.path.join(out, "hs_11.safetensors"))
