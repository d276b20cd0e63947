"""The shard's total tokens (worker/sizing.py): exactly the tokens the extraction writes, sent on
the worker's progress events so the supervisor can compare and estimate in tokens."""

from __future__ import annotations

import json
import os

import pytest

from worker.data import open_dataset
from worker.extract import Options
from worker.sizing import shard_tokens
from tests.conftest import read_events, run_worker


def manifest_tokens(out: str) -> int:
    return sum(json.loads(l).get("tokens", 0) for p in os.listdir(os.path.join(out, "manifest"))
               for l in open(os.path.join(out, "manifest", p)) if l.strip())


@pytest.mark.parametrize("too_long", ["truncate", "skip"])
def test_shard_tokens_follow_the_extraction_rules(token_data, too_long):
    rows = [json.loads(l) for l in open(token_data)][10:50]
    options = Options(max_length=30, too_long=too_long)
    got = shard_tokens(open_dataset(token_data), 10, 50, 500, lambda: None, options)
    if too_long == "truncate":      # cut to 30 tokens; a row left with nothing supervised is skipped
        expected = sum(min(len(r["input_ids"]), 30) for r in rows if any(r["loss_mask"][:30]))
    else:
        expected = sum(len(r["input_ids"]) for r in rows if len(r["input_ids"]) <= 30 and any(r["loss_mask"]))
    assert got == expected and expected > 0
    assert shard_tokens(open_dataset(token_data), 10, 50, 10, lambda: None, Options()) == 0   # every id out of vocab


def test_worker_sends_total_tokens_equal_to_what_it_writes(tmp_path, dense_model):
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 400, vocab_size=500, mean_tokens=40, seed=5)
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = run_worker("--model", dense_model, "--data", data, "--out", out, "--state", state,
                   "--max-tokens-per-batch", "256", "--dtype", "fp32", "--device", "cpu",
                   "--progress-interval", "0.1")
    assert r.returncode == 0, r.stderr
    sized = {e["total_tokens"] for e in read_events(state) if e.get("total_tokens") is not None}
    assert sized == {manifest_tokens(out)}
    assert all(e["event"] in ("progress", "done") for e in read_events(state) if "total_tokens" in e)
