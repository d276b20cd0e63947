"""`dtype` in fleet.toml (refused, with its line, for a format whose trainer cannot dequantise
fp8) and in a run's plan made before the key existed (it meant bf16)."""

from __future__ import annotations

import pytest

from fleet.config import ConfigError, load_config
from fleet.plan import plan_differences
from worker.protocol import Plan
from tests.faults.test_hostile_inputs import local_toml


def test_dtype_in_fleet_toml_and_plans_made_before_it(tmp_path):
    body = '[run]\nname = "r"\nmodel = "m"\ndata = "d.jsonl"\noutput = "o"\nformat = "{fmt}"\ndtype = "{dtype}"\n'
    for fmt in ("specforge-eagle3", "specforge-dflash", "eagle"):
        path = local_toml(tmp_path, body.format(fmt=fmt, dtype="fp8"))
        with pytest.raises(ConfigError) as e:
            load_config(path)
        assert f"fleet.toml:7: run.dtype: format {fmt} is read by" in str(e.value)
        assert "cannot dequantise fp8" in str(e.value) and "\n" not in str(e.value)
    assert load_config(local_toml(tmp_path, body.format(fmt="speculators", dtype="fp8"))).run.dtype == "fp8"
    assert load_config(local_toml(tmp_path, body.replace('dtype = "{dtype}"\n', "").format(fmt="eagle"))).run.dtype == "bf16"
    # A plan made before dtype existed: its spec and identity hold none, and meant bf16.
    shards = [{"id": 0, "host": "h", "gpu": 0}]
    old = {"shards": shards, "spec": {"format": "speculators"}, "identity": {"format": "speculators", "layer_ids": [1]}}
    new = {"shards": shards, "spec": {"format": "speculators", "dtype": "bf16"},
           "identity": {"format": "speculators", "layer_ids": [1], "dtype": "bf16"}}
    fp8 = {**new, "spec": {**new["spec"], "dtype": "fp8"}, "identity": {**new["identity"], "dtype": "fp8"}}
    old, new, fp8 = (Plan.from_dict(p) for p in (old, new, fp8))
    assert plan_differences(old, new) == []
    assert plan_differences(old, fp8) == ["dtype: bf16 -> fp8", "dtype: bf16 -> fp8"]


def test_verify_merge_refuses_hosts_with_bf16_and_fp8():
    from fleet.verify import merge_reports
    from worker.protocol import VerifyReport
    a = {"num_samples": 4, "format": "speculators", "dtype": "fp8", "written": [[0, 2]], "skipped": {}, "problems": []}
    b = {"num_samples": 4, "format": "speculators", "dtype": "bf16", "written": [[2, 4]], "skipped": {}, "problems": []}
    a, b = VerifyReport.from_dict(a), VerifyReport.from_dict(b)
    result = merge_reports({"box1": a, "box2": b})
    assert result.problems == ["box2: hidden states in bf16, another host's in fp8"] and not result.ok
    assert merge_reports({"box1": a}).dtype == "fp8"
