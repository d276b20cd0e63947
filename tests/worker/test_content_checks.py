"""Output checked for what it says (issue 36), through the real worker on the tiny models.

Each class of silent wrong output the peers shipped is switched on in the worker's real path
(worker/inject.py: a layer zeroed after the compiled region, two rows of a batch swapped, padding
leaking into a short row, fp8 scales dropped): the reference forward of a chosen row names the
layer and the row, the shard stops for good, and verify of the folder exits with the reason. A
clean run, dense and hybrid, bf16 and fp8, over several datasets, passes every check. Files edited
after the fact (a layer overwritten with zeros, one sample's file copied over another's of the same
length) are named by their statistics, and --repair has exactly those redone."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.conftest import read_events, run_worker
from worker.verify import check_folder

ROWS = 24


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    from worker.demo import make_chat_dataset
    return {seed: make_chat_dataset(str(tmp_path_factory.mktemp("cc") / f"chat{seed}.jsonl"), ROWS,
                                    mean_words=18, seed=seed) for seed in (1, 2, 3)}


def extract(model: str, data: str, out: str, state: str, *more: str, env: dict | None = None):
    return run_worker("--model", model, "--data", data, "--out", out, "--state", state, "--device", "cpu",
                      "--random-weights", "--max-tokens-per-batch", "384", "--reference-checks", "1", *more,
                      env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("bug,dtype", [("zero-layer", "bf16"), ("swap-rows", "bf16"), ("pad-leak", "bf16"),
                                       ("fp8-no-scales", "fp8")])
def test_each_silent_bug_is_caught_naming_layer_and_row_and_the_shard_stops(models, chats, tmp_path, bug, dtype):
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = extract(models["qwen3"], chats[1], out, state, "--dtype", dtype, env={"FLEET_INJECT_BUG": bug})
    assert r.returncode == 1, r.stderr[-2000:]
    failed = [e for e in read_events(state) if e["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["fatal"], failed
    reason = failed[0]["reason"]
    assert reason.startswith("layer ") and " of row " in reason and "against the reference forward" in reason, reason
    checked = [e for e in read_events(state) if e["event"] == "checked"][-1]
    assert checked["failed"] == reason
    report = check_folder(out)
    assert any(p == f"shard 0 stopped for good: {reason}" for p in report.problems), report.problems


def test_a_mask_moved_off_the_assistant_turns_stops_the_shard_naming_the_row(models, chats, tmp_path):
    """The loss mask moved onto the prompt before each assistant turn (what a template change that
    shifts the mask looks like) is named by the checked row's mask check, against the chat
    template's rendering; the states themselves are right, so only the mask check can see it."""
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = extract(models["qwen3"], chats[1], out, state, env={"FLEET_INJECT_BUG": "mask-early"})
    assert r.returncode == 1, r.stderr[-2000:]
    failed = [e for e in read_events(state) if e["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["fatal"], failed
    reason = failed[0]["reason"]
    assert reason.startswith("row ") and ": its loss mask: " in reason and "turn" in reason, reason
    line = [json.loads(x) for x in open(os.path.join(out, "checks", "0.jsonl"))][-1]
    assert line["mask"]["problem"] in reason and min(line["cosine"]) > 0.99     # the states were right
    assert f"shard 0 stopped for good: {reason}" in check_folder(out).problems


@pytest.mark.parametrize("arch,dtype", [("qwen3", "bf16"), ("qwen3", "fp8"), ("qwen3_5_text", "bf16")])
def test_a_clean_run_passes_every_check_over_several_datasets(models, chats, tmp_path, arch, dtype):
    for seed, data in chats.items():
        out, state = str(tmp_path / f"out{seed}"), str(tmp_path / f"state{seed}")
        r = extract(models[arch], data, out, state, "--dtype", dtype)
        assert r.returncode == 0, r.stderr[-2000:]
        checked = [e for e in read_events(state) if e["event"] == "checked"][-1]
        assert checked["rows"] == ROWS and checked.get("failed") is None      # --reference-checks 1: every row
        assert checked["masks"] == ROWS                                       # raw chats: each mask too
        lines = [json.loads(line) for line in open(os.path.join(out, "checks", "0.jsonl"))]
        assert sorted(line["index"] for line in lines) == list(range(ROWS))
        report = check_folder(out)
        assert report.problems == [] and report.checked_rows == ROWS
        assert report.worst_cosine == checked["worst_cosine"] and min(report.worst_cosine) > 0.99


def test_files_edited_after_the_fact_are_named_and_repair_redoes_exactly_them(models, chats, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    assert extract(models["qwen3"], chats[2], out, state, "--reference-checks", "0").returncode == 0
    records = {json.loads(line)["index"]: json.loads(line) for line in open(os.path.join(out, "manifest", "0.jsonl"))}
    zeroed = 3
    path = os.path.join(out, f"hs_{zeroed}.safetensors")
    with safe_open(path, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    tensors["hidden_states"][:, 1] = 0                       # one layer overwritten with zeros
    save_file(tensors, path, metadata=meta)
    same = [(a, b) for a in records for b in records if a < b and records[a]["tokens"] == records[b]["tokens"]
            and a != zeroed and b != zeroed]
    src, dst = same[0]                                       # one file copied over another of its length
    shutil.copy(os.path.join(out, f"hs_{src}.safetensors"), os.path.join(out, f"hs_{dst}.safetensors"))
    problems = check_folder(out).problems
    named = sorted(int(p.split(":")[0].split()[1]) for p in problems)
    assert named == sorted([zeroed, dst]), problems
    assert any("holds other values than were written" in p for p in problems)
    repaired = check_folder(out, repair=True).repaired
    assert sorted(repaired.dropped) == sorted([zeroed, dst])
    r = extract(models["qwen3"], chats[2], out, state, "--reference-checks", "0")
    assert r.returncode == 0 and check_folder(out).problems == []
    redone = [e for e in read_events(state) if e["event"] == "leased"][-1]
    assert redone["rows"] == 2


def test_the_statistics_name_what_no_model_writes(models, chats, tmp_path):
    """The anomalies of worker/stats.py over a real run's records, edited as a bug would leave them:
    a layer all zero, two layers alike, a sample's states the same as another's of its length with
    other tokens, an RMS a thousand times the run's; and rows of one token repeated, whose states are
    the same at any length, are no anomaly."""
    from worker.stats import anomalies
    out = str(tmp_path / "out")
    assert extract(models["qwen3"], chats[3], out, str(tmp_path / "s"), "--reference-checks", "0").returncode == 0
    records = [json.loads(line) for line in open(os.path.join(out, "manifest", "0.jsonl"))]
    ids = json.load(open(os.path.join(out, "meta.json")))["layer_ids"]
    assert anomalies(records, ids) == {}
    edited = [dict(r, stats=[list(row) for row in r["stats"]]) for r in records]
    a, b, c, d = (edited[k]["index"] for k in range(4))
    edited[0]["stats"][1] = [0.0, 0.0, 1.0, 0.0]
    edited[1]["stats"][2] = list(edited[1]["stats"][3])
    edited[2]["stats"] = [list(row) for row in edited[4]["stats"]]    # another row's states, as many tokens
    edited[2]["tokens"] = edited[4]["tokens"]
    edited[3]["stats"][0][0] *= 1000
    edited[3]["stats"][0][1] *= 1000
    e = edited[4]["index"]
    found = anomalies(edited, ids)
    twin = c if c in found else e                         # (the later of the two in the manifest)
    assert set(found) == {a, b, twin, d}, found
    assert found[a] == f"layer {ids[1]}: all zero"
    assert found[b] == f"layers {ids[2]} and {ids[3]} hold the same values"
    assert found[twin] == f"the same states as sample {c + e - twin}, whose tokens differ"
    assert found[d].startswith(f"layer {ids[0]}: rms ")
    # one token repeated: every position's state is the same, whatever the length
    out2 = str(tmp_path / "out2")
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"input_ids": [7] * n}) + "\n" for n in (40, 20, 30)))
    assert extract(models["qwen3"], str(tmp_path / "same.jsonl"), out2, str(tmp_path / "s2"),
                   "--reference-checks", "0").returncode == 0
    assert anomalies([json.loads(line) for line in open(os.path.join(out2, "manifest", "0.jsonl"))], ids) == {}


def test_fleet_shows_the_checks_where_people_look(models, chats, tmp_path):
    """Through fleet up on a local host: status --json has each shard's and the run's reference
    checks, the finished line says them, fleet verify prints the worst cosine per layer; with
    reference_checks = "off" none runs."""
    from tests.faults.test_hostile_inputs import local_toml
    from tests.fleet.conftest import fleet
    config = local_toml(tmp_path, f"""[run]
name = "cc"
model = {json.dumps(models["qwen3"])}
data = {json.dumps(chats[1])}
output = "out"
device = "cpu"
max_tokens_per_batch = 384
reference_checks = 3
env = {{ OMP_NUM_THREADS = "1" }}
""")
    up = fleet("up", "--headless", "-c", config, timeout=600)
    assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
    snap = json.loads(fleet("status", "--json", "-c", config).stdout)
    shard, run = snap["shards"][0]["reference"], snap["totals"]["reference"]
    checked = len(open(tmp_path / "out" / "checks" / "0.jsonl").read().splitlines())
    assert shard["rows"] == run["rows"] == checked >= 8 and shard["failed"] is None
    assert min(shard["worst_cosine"]) > 0.99 and shard["layer_ids"] == json.load(open(tmp_path / "out" / "meta.json"))["layer_ids"]
    status = fleet("status", "-c", config).stdout
    assert f"checked {checked} rows ✓ (worst cosine" in status, status
    v = fleet("verify", "-c", config)
    assert v.returncode == 0 and f"reference checks: {checked} row(s) re-computed alone; worst cosine per layer: " \
        in v.stdout, v.stdout
    text = open(config).read().replace("reference_checks = 3", 'reference_checks = "off"').replace('name = "cc"', 'name = "off"')
    open(config, "w").write(text.replace('output = "out"', 'output = "out-off"'))
    assert fleet("up", "--headless", "-c", config, timeout=600).returncode == 0
    assert not (tmp_path / "out-off" / "checks").exists()
    assert json.loads(fleet("status", "--json", "-c", config).stdout)["shards"][0]["reference"] is None


def test_a_checked_row_is_compared_with_what_was_written_not_with_a_reused_buffer(models, chats, tmp_path):
    """A writer that lags (it waits for shipping at keep_local) lets the next batches be copied into
    the very host buffer a checked row's states were written from before its check runs: the check
    holds its own copy, so a clean run passes (a shipping run in CI failed every such row when it
    held a view of the buffer)."""
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = extract(models["qwen3"], chats[1], out, state, "--writer-queue", "1", "--destination",
                str(tmp_path / "dest"), "--keep-local", "60000")
    assert r.returncode == 0, r.stderr[-2000:]
    checked = [e for e in read_events(state) if e["event"] == "checked"][-1]
    assert checked["rows"] == ROWS and checked.get("failed") is None


def test_a_model_that_gives_all_zero_states_is_named_as_the_cause_not_the_path(models, chats, tmp_path):
    """Issue 53: every weight zero, so the model's own forward gives all-zero states, which the
    worker writes faithfully. The check stops the shard saying the model produced them, never that
    the written states or the extraction path are wrong."""
    import torch
    from safetensors.torch import load_file, save_file
    model = str(tmp_path / "zeros")
    shutil.copytree(models["qwen3"], model)
    weights = load_file(os.path.join(model, "model.safetensors"))
    save_file({k: torch.zeros_like(v) for k, v in weights.items()}, os.path.join(model, "model.safetensors"),
              metadata={"format": "pt"})
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = run_worker("--model", model, "--data", chats[1], "--out", out, "--state", state, "--device", "cpu",
                   "--max-tokens-per-batch", "384", "--reference-checks", "1",
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1, r.stderr[-2000:]
    [failed] = [e for e in read_events(state) if e["event"] == "failed"]
    assert failed["fatal"] and "the model itself gives all-zero hidden states there" in failed["reason"], failed
    assert "the written states are wrong" not in failed["reason"] and "its path" not in failed["reason"]
