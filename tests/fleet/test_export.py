"""A run in a trainer's format through fleet and a real sshd: up, verify, then `fleet export`
converting every host's output to another layout."""

from __future__ import annotations

import json
import os

import pytest

from worker.verify import verify
from tests.fleet.conftest import fleet, fleet_toml

@pytest.mark.ssh
def test_up_in_specforge_format_verify_then_export_to_eagle(tmp_path, sshd, dense_model):
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 40, vocab_size=500, mean_tokens=30, seed=4)
    path = fleet_toml(tmp_path, model=dense_model, data=data, port=sshd.port, client_key=sshd.client_key,
                      known_hosts=sshd.known_hosts, extra_run='format = "specforge-eagle3"\nloss_mask = "all"')
    with open(path) as f:
        text = f.read().replace('layers = "speculators"\n', "")        # the format's own preset
    with open(path, "w") as f:
        f.write(text)
    r = fleet("up", "--headless", "-c", path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = os.path.join(tmp_path, "remote", "out")
    meta = json.load(open(os.path.join(out, "meta.json")))
    assert meta["format"] == "specforge-eagle3" and meta["layer_ids"] == [2, 4, 5, 8]
    v = fleet("verify", "-c", path)
    assert v.returncode == 0 and "40 written" in v.stdout and "verify: OK" in v.stdout
    assert "(format specforge-eagle3)" in v.stdout
    # the exact command that trains on it, every flag from meta.json (SpecForge's numbering: hs - 1)
    assert (f"train (box): specforge train -c run.yaml model.target_model_path={meta['model']} "
            f"data.hidden_states_path={out} data.max_length=2048 training.strategy=eagle3  "
            f"# run.yaml: model.aux_hidden_state_layer_ids: [1, 3, 4]") in v.stdout

    eagle = os.path.join(tmp_path, "remote", "eagle")
    e = fleet("export", "--format", "eagle", "--out", eagle, "-c", path)
    assert e.returncode == 0, e.stdout + e.stderr
    assert e.stdout.strip() == f"box: 40 written, 0 skipped -> {eagle} (eagle)"
    rep = verify(eagle)
    assert rep["problems"] == [] and rep["written"] == [[0, 40]] and rep["format"] == "eagle"
    files = [f for _, _, names in os.walk(os.path.join(eagle, "data")) for f in names]
    assert len(files) == 40 and all(f.startswith("data_") and f.endswith(".ckpt") for f in files)

    bad = fleet("export", "--format", "eagle", "--out", out, "-c", path)     # onto its own source
    assert bad.returncode == 1 and "another folder" in bad.stderr

