"""Issue 21: the output is what this model and this data say, or the shard stops and says why.

Strict weights, GPT-2-style configs, transient failures retried alone, padding that cannot spoil
clean rows, one run per output folder, a dataset edited in place. Real worker processes on the
tiny random models of tests/conftest.py.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import REPO, read_events, run_worker


def manifest(out: str) -> dict[int, dict]:
    recs = {}
    for p in glob.glob(os.path.join(out, "manifest", "*.jsonl")):
        for line in open(p):
            if line.strip():
                rec = json.loads(line)
                recs[rec["index"]] = rec
    return recs


def failed(state: str) -> dict:
    return [e for e in read_events(state) if e["event"] == "failed"][-1]


def preflight(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "worker.preflight", "--builtin", "--device", "cpu", *args],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def errors(report: dict) -> list[str]:
    return [c["message"] for c in report["checks"] if c["level"] == "error"]


def copy_model(src: str, dst) -> str:
    dst = str(dst)
    shutil.copytree(src, dst)
    return dst


# --- 1. strict loading --------------------------------------------------------------------------

def test_a_missing_weight_refuses_the_shard_naming_the_tensor(tmp_path, dense_model, token_data):
    model = copy_model(dense_model, tmp_path / "model")
    weights = load_file(os.path.join(model, "model.safetensors"))
    del weights["model.layers.3.mlp.up_proj.weight"]
    save_file(weights, os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = run_worker("--model", model, "--data", token_data, "--out", out, "--state", state)
    assert r.returncode != 0
    event = failed(state)
    assert "layers.3.mlp.up_proj.weight" in event["reason"] and "missing" in event["reason"]
    assert event["fatal"] and "Traceback" not in r.stderr
    assert not glob.glob(os.path.join(out, "hs_*"))


def test_an_unexpected_weight_of_the_base_model_refuses_the_shard(tmp_path, dense_model, token_data):
    model = copy_model(dense_model, tmp_path / "model")
    weights = load_file(os.path.join(model, "model.safetensors"))
    weights["model.layers.0.mlp.extra.weight"] = weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, os.path.join(model, "model.safetensors"), metadata={"format": "pt"})
    state = str(tmp_path / "state")
    r = run_worker("--model", model, "--data", token_data, "--out", str(tmp_path / "out"), "--state", state)
    assert r.returncode != 0
    reason = failed(state)["reason"]
    assert "model.layers.0.mlp.extra.weight" in reason and "layers.1.mlp.up_proj.weight" in reason


def test_preflight_names_a_missing_or_truncated_weight_file(tmp_path, dense_model):
    model = copy_model(dense_model, tmp_path / "model")
    weights = load_file(os.path.join(model, "model.safetensors"))
    names = sorted(weights)
    half = len(names) // 2
    os.remove(os.path.join(model, "model.safetensors"))
    save_file({k: weights[k] for k in names[:half]}, os.path.join(model, "part-1.safetensors"))
    save_file({k: weights[k] for k in names[half:]}, os.path.join(model, "part-2.safetensors"))
    index = {"metadata": {}, "weight_map": {k: f"part-{1 if i < half else 2}.safetensors"
                                            for i, k in enumerate(names)}}
    with open(os.path.join(model, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    assert errors(preflight("--model", model)) == []

    part2 = os.path.join(model, "part-2.safetensors")
    data = open(part2, "rb").read()
    with open(part2, "wb") as f:
        f.write(data[: len(data) - 1000])                      # a copy cut short
    [message] = errors(preflight("--model", model))
    assert "part-2.safetensors: truncated" in message

    os.remove(part2)
    [message] = errors(preflight("--model", model))
    assert "model.safetensors.index.json names 1 weight file(s) that are not there: part-2.safetensors" in message


def test_a_gpt2_style_config_is_read_through_transformers(tmp_path, token_data):
    from transformers import GPT2Config, GPT2Model
    model = str(tmp_path / "gpt2")
    GPT2Model(GPT2Config(n_embd=32, n_layer=4, n_head=2, n_positions=100, vocab_size=500)).save_pretrained(model)
    assert errors(preflight("--model", model)) == []
    out = str(tmp_path / "out")
    r = run_worker("--model", model, "--data", token_data, "--out", out, "--model-dtype", "fp32",
                   "--max-tokens-per-batch", "512", "--max-skip-fraction", "1")
    assert r.returncode == 0, r.stderr
    recs = manifest(out)
    rows = [json.loads(l) for l in open(token_data)]
    assert len(recs) == len(rows)
    assert sum("skipped" in r for r in recs.values()) == 5
    for i, row in enumerate(rows):            # longer than n_positions: skipped, saying so
        assert ("skipped" in recs[i]) == (len(row["input_ids"]) > 100), recs[i]


# --- 2. transient failures, crash loops ---------------------------------------------------------

INJECT = os.path.join(REPO, "tests", "faults", "inject")


def injected(**env: str) -> dict:
    return {**os.environ, "PYTHONPATH": f"{REPO}:{INJECT}", **env}


def write_rows(path, rows: list[list[int]]) -> str:
    path.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    return str(path)


def test_an_out_of_memory_that_passes_skips_nothing(tmp_path, dense_model, token_data):
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = run_worker("--model", dense_model, "--data", token_data, "--out", out, "--state", state,
                   "--max-tokens-per-batch", "512", env=injected(FLEET_INJECT_OOM_TIMES="12"))
    assert r.returncode == 0, r.stderr
    recs = manifest(out)
    assert len(recs) == 60 and not [r for r in recs.values() if "skipped" in r]
    assert not [e for e in read_events(state) if e["event"] == "sample_skipped"]


def test_a_row_that_kills_the_process_is_isolated_in_one_more_launch(tmp_path, dense_model):
    """A row whose batch aborts the process (as a CUDA device-side assert does): the next launch
    writes the rest first, then runs the suspects alone and dies on the culprit alone; the one
    after skips it, saying why. Longest first would otherwise put it first on every launch."""
    rows = [[7] * n for n in range(20, 60)]
    rows[25] = [7] * 200 + [13]                      # the longest: first batch of every launch
    data = write_rows(tmp_path / "d.jsonl", rows)
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    args = ("--model", dense_model, "--data", data, "--out", out, "--state", state,
            "--max-tokens-per-batch", "512", "--max-skip-fraction", "0.1")
    env = injected(FLEET_INJECT_ABORT_TOKEN="13")
    first = run_worker(*args, env=env)
    assert first.returncode == -6 and manifest(out) == {}
    second = run_worker(*args, env=env)
    assert second.returncode == -6
    # the rest went first; 39 shared the culprit's batch and waits its turn, alone, after 25
    assert sorted(manifest(out)) == sorted(set(range(40)) - {25, 39})
    third = run_worker(*args, env=env)
    assert third.returncode == 0, third.stderr
    recs = manifest(out)
    assert sorted(recs) == list(range(40))
    assert [i for i, r in recs.items() if "skipped" in r] == [25]
    assert "died while this row ran alone" in recs[25]["skipped"]


def test_a_stop_does_not_make_suspects(tmp_path, dense_model, token_data):
    from worker.suspects import Suspects, suspects_path
    path = suspects_path(str(tmp_path), 0)
    s = Suspects(path, set(), 0, 10)
    s.starting([1, 2, 3])
    assert Suspects(path, set(), 0, 10).rows == {1, 2, 3}    # a crash here: suspects next time
    s = Suspects(path, {1}, 0, 10)
    s.starting([4])
    s.settled()                                               # a stop: what ran is not to blame
    assert Suspects(path, {1}, 0, 10).rows == {2, 3}


# --- 3. padding ---------------------------------------------------------------------------------

def test_a_non_finite_padding_embedding_never_drops_clean_rows(tmp_path, dense_model):
    """Token 0's embedding is NaN (an untrained padding row): batches of rows of different
    lengths still write every row, and each equals the model's own unpadded forward."""
    import numpy as np
    from worker.model import Capture, find_decoder, load_model
    from worker.layers import resolve_layers
    model_dir = copy_model(dense_model, tmp_path / "model")
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    weights["model.embed_tokens.weight"][0] = float("nan")
    save_file(weights, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    rng = np.random.default_rng(5)
    rows = [rng.integers(1, 500, n).tolist() for n in (9, 30, 17, 64, 12, 41)]
    data = write_rows(tmp_path / "d.jsonl", rows)
    out = str(tmp_path / "out")
    r = run_worker("--model", model_dir, "--data", data, "--out", out, "--model-dtype", "fp32",
                   "--max-tokens-per-batch", "4096")
    assert r.returncode == 0, r.stderr
    assert sorted(manifest(out)) == list(range(len(rows)))
    assert not [rec for rec in manifest(out).values() if "skipped" in rec]
    model = load_model(model_dir, "cpu", torch.float32)
    capture = Capture(find_decoder(model), resolve_layers("speculators", 8))
    for i, row in enumerate(rows):
        with torch.inference_mode():
            model(input_ids=torch.tensor([row]))
        want = capture.take()[0]
        got = load_file(os.path.join(out, f"hs_{i}.safetensors"))["hidden_states"]
        err = float((got.float() - want.float()).norm() / want.float().norm())
        assert err < 1e-2, (i, err)                 # bf16 storage; batched vs alone


# --- 4. one writer per output folder ------------------------------------------------------------

def plan_file(tmp_path, run: str, created: float, model: str, data: str) -> str:
    """A plan as fleet writes it, for the worker's default layers."""
    from worker.identity import output_identity, work_identity
    from worker.layers import resolve_layers
    identity = work_identity(model, data, output_identity(resolve_layers("speculators", 8), "speculators",
                                                          "assistant", "bf16"))
    path = tmp_path / f"plan-{run}.json"
    path.write_text(json.dumps({"version": 1, "run": run, "created": created, "identity": identity.to_dict()}))
    return str(path)


def test_another_run_into_the_same_output_is_refused_naming_the_owner(tmp_path, dense_model, token_data):
    out = str(tmp_path / "out")
    base = ("--model", dense_model, "--data", token_data, "--out", out, "--max-tokens-per-batch", "512")
    r = run_worker(*base, "--plan", plan_file(tmp_path, "a", 1.0, dense_model, token_data), "--num-shards", "2")
    assert r.returncode == 0, r.stderr
    before = manifest(out)
    state = str(tmp_path / "state-b")
    r = run_worker(*base, "--plan", plan_file(tmp_path, "b", 2.0, dense_model, token_data), "--state", state)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    reason = failed(state)["reason"]
    assert "belongs to run 'a'" in reason and "Give this run another output" in reason
    assert failed(state)["fatal"] and manifest(out) == before
    r = run_worker(*base, "--plan", plan_file(tmp_path, "a", 1.0, dense_model, token_data), "--num-shards", "2", "--shard-index", "1")
    assert r.returncode == 0, r.stderr                     # the owner itself goes on
    assert len(manifest(out)) == 60


def test_a_second_process_for_a_shard_being_written_is_refused(tmp_path, dense_model, token_data):
    from worker.writer import OwnerError, claim_output
    out = str(tmp_path / "out")
    held = claim_output(out, "a", 1.0, 0)                    # a live writer of shard 0 (this process)
    state = str(tmp_path / "state")
    r = run_worker("--model", dense_model, "--data", token_data, "--out", out, "--state", state,
                   "--plan", plan_file(tmp_path, "a", 1.0, dense_model, token_data))
    assert r.returncode != 0
    assert f"shard 0 of {out} is being written by pid {os.getpid()}" in failed(state)["reason"]
    held.close()
    with pytest.raises(OwnerError, match="belongs to run 'a'"):
        claim_output(out, "b", 2.0, 1)


def test_an_export_from_another_source_into_an_export_folder_is_refused(runs, tmp_path):
    dst = str(tmp_path / "exp")
    ok = subprocess.run([sys.executable, "-m", "worker.export", runs["specforge-eagle3"], "--format",
                         "specforge-dflash", "--out", dst], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    meta_before = open(os.path.join(dst, "meta.json")).read()
    r = subprocess.run([sys.executable, "-m", "worker.export", runs["eagle3-official"], "--format",
                        "specforge-dflash", "--out", dst], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and f"holds an export of {runs['specforge-eagle3']}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and open(os.path.join(dst, "meta.json")).read() == meta_before


# --- 6. the dataset's content -------------------------------------------------------------------

def test_a_dataset_edited_in_place_is_refused_at_the_next_launch(tmp_path, dense_model):
    """Same size, same row count, same first and last rows: only the content hash tells."""
    rows = [[5 + i % 7] * 12 for i in range(20)]
    data = write_rows(tmp_path / "d.jsonl", rows)
    plan = plan_file(tmp_path, "a", 1.0, dense_model, data)
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    base = ("--model", dense_model, "--data", data, "--out", out, "--state", state, "--plan", plan)
    assert run_worker(*base, "--num-shards", "2").returncode == 0
    rows[7] = [9] * 12                                   # one middle row, same length
    write_rows(tmp_path / "d.jsonl", rows)
    r = run_worker(*base, "--num-shards", "2", "--shard-index", "1")
    assert r.returncode == 1 and "data.content:" in failed(state)["reason"] and failed(state)["fatal"]
    assert len(manifest(out)) == 10                      # shard 1 wrote nothing from the new version


# --- 7. also from the probe ---------------------------------------------------------------------

def test_a_single_file_parquet_dataset_passes_preflight_and_runs(tmp_path, dense_model, token_data):
    import pyarrow as pa
    import pyarrow.parquet as pq
    rows = [json.loads(l) for l in open(token_data)][:12]
    data = str(tmp_path / "d.parquet")
    pq.write_table(pa.Table.from_pylist(rows), data)
    report = preflight("--model", dense_model, "--data", data, "--output", str(tmp_path / "out"))
    assert errors(report) == [] and report["footprint"]["rows"] == 12
    r = run_worker("--model", dense_model, "--data", data, "--out", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert len(manifest(str(tmp_path / "out"))) == 12


def test_temp_files_a_killed_writer_left_are_removed_by_the_next(tmp_path, dense_model, token_data, runs):
    """A kill between a temp file's write and its rename leaves `.tmp-<index>-...` behind: the
    next writer of those samples removes them (the extractor its shard's range, an export all)."""
    out = str(tmp_path / "out")
    os.makedirs(out)
    for name in (".tmp-3-999-1", ".tmp-45-999-1"):
        open(os.path.join(out, name), "w").write("half a file")
    r = run_worker("--model", dense_model, "--data", token_data, "--out", out, "--num-shards", "2")
    assert r.returncode == 0, r.stderr
    assert sorted(n for n in os.listdir(out) if n.startswith(".tmp-")) == [".tmp-45-999-1"]   # shard 1's
    dst = str(tmp_path / "exp")
    os.makedirs(dst)
    open(os.path.join(dst, ".tmp-2-999-1"), "w").write("half a file")
    e = subprocess.run([sys.executable, "-m", "worker.export", runs["specforge-eagle3"], "--format",
                        "specforge-dflash", "--out", dst], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert e.returncode == 0, e.stderr
    assert not [n for n in os.listdir(dst) if n.startswith(".tmp-")]


def test_repair_reopens_the_skips_of_failures_that_may_pass(tmp_path, dense_model, token_data):
    """A row that ran out of memory even alone is skipped, but not for good: `--repair` drops its
    record (a bad row's stays), and a launch on a bigger GPU writes it."""
    from worker.verify import verify
    rows = [[7] * 20 for _ in range(10)] + [[7] * 300, {"bad": 1}]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r if isinstance(r, dict) else {"input_ids": r}) + "\n" for r in rows))
    out = str(tmp_path / "out")
    args = ("--model", dense_model, "--data", str(data), "--out", out, "--max-skip-fraction", "0.5")
    r = run_worker(*args, env=injected(FLEET_INJECT_OOM_ABOVE="256"))
    assert r.returncode == 0, r.stderr
    assert sorted(i for i, rec in manifest(out).items() if "skipped" in rec) == [10, 11]
    report = verify(out, repair=True)
    assert report["repaired"]["retried_skips"] == [10] and list(report["skipped"]) == ["11"]
    assert run_worker(*args).returncode == 0                        # no injected limit: it fits
    recs = manifest(out)
    assert "skipped" not in recs[10] and "skipped" in recs[11]
