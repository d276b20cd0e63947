"""The shard's total tokens (worker/sizing.py): exactly the tokens the extraction writes, sent on
the worker's progress events so the supervisor can compare and estimate in tokens."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

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


def small_run(tmp_path, model: str, rows: int, seed: int) -> tuple[str, str]:
    """The real worker over `rows` short token rows, batches of 256 tokens, progress every 0.1 s;
    returns its output and state folders."""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), rows, vocab_size=500, mean_tokens=40, seed=seed)
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = run_worker("--model", model, "--data", data, "--out", out, "--state", state,
                   "--max-tokens-per-batch", "256", "--dtype", "fp32", "--device", "cpu",
                   "--progress-interval", "0.1")
    assert r.returncode == 0, r.stderr
    return out, state


def test_worker_sends_total_tokens_equal_to_what_it_writes(tmp_path, dense_model):
    out, state = small_run(tmp_path, dense_model, 400, 5)
    sized = {e["total_tokens"] for e in read_events(state) if e.get("total_tokens") is not None}
    assert sized == {manifest_tokens(out)}
    assert all(e["event"] in ("progress", "done") for e in read_events(state) if "total_tokens" in e)


def test_worker_sends_the_cost_of_its_work_equal_to_what_it_writes(tmp_path, dense_model):
    """Issue 25's ETA prices the work left: the totals the worker sends (rows, tokens squared) are
    what it writes, the done counters reach them, the FLOP model's weight is sent, and the first
    batch's start (`batches_from`) comes before any row is counted."""
    out, state = small_run(tmp_path, dense_model, 300, 6)
    written = [json.loads(l) for p in os.listdir(os.path.join(out, "manifest"))
               for l in open(os.path.join(out, "manifest", p)) if l.strip() and "skipped" not in l]
    events = [e for e in read_events(state) if e["event"] in ("progress", "done")]
    sized = {(e["total_rows"], e["total_sq_tokens"]) for e in events if e.get("total_rows") is not None}
    assert sized == {(len(written), sum(w["tokens"] ** 2 for w in written))}
    assert events[-1]["sq_tokens"] == events[-1]["total_sq_tokens"]
    assert {e["attention_weight"] for e in events if "attention_weight" in e} and \
        all(0 < e["attention_weight"] < 1 for e in events if "attention_weight" in e)
    begun = {e["batches_from"] for e in events if "batches_from" in e}
    assert len(begun) == 1
    first_batch = begun.pop()
    assert all(e["t"] >= first_batch for e in events if e.get("tokens"))
    # Each batch is timed from when its rows were counted (`counted_t`), not from the tick that
    # reported them: the stamp moves exactly when the tokens do, after the first batch began and
    # never after the event that carries it.
    counted = [e for e in events if e.get("tokens")]
    assert all(first_batch <= e["counted_t"] <= e["t"] for e in counted)
    assert all((a["tokens"] == b["tokens"]) == (a["counted_t"] == b["counted_t"])
               for a, b in zip(counted, counted[1:]))
    assert len({e["counted_t"] for e in counted}) > 1
    # On a CPU the weight is timed at load, as its own LOADING step, before `loaded`.
    kinds = [(e["event"], e.get("detail") or "") for e in read_events(state)]
    timing = next(i for i, (k, d) in enumerate(kinds) if k == "loading" and d.startswith("timing a long row"))
    assert timing < kinds.index(("loaded", ""))


class Timed:
    """A forward whose seconds are the cost model itself: rows x width x c x (1 + w x width), with
    a burst (x `burst`) on the tries listed in `spoiled`."""

    def __init__(self, c: float, w: float, spoiled=(), burst: float = 3.0):
        self.c, self.w, self.spoiled, self.burst, self.calls = c, w, set(spoiled), burst, 0

    def __call__(self, rows: int, width: int) -> float:
        self.calls += 1
        seconds = rows * width * self.c * (1 + self.w * width)
        return seconds * (self.burst if self.calls in self.spoiled else 1.0)


@given(w=st.floats(1e-5, 1e-2), c=st.floats(1e-7, 1e-3), spoiled=st.sampled_from([(), (2,), (5,), (3,), (6,)]))
def test_measured_weight_is_the_weight_the_times_come_from(w, c, spoiled):
    """The weight measured from a forward timed by the cost model is the model's weight, also when
    one of the three pairs of tries is hit by a burst of another process's work (calls 2-7 are
    the timed ones: long, short, long, short, long, short)."""
    from worker.sizing import measured_weight
    assert measured_weight(Timed(c, w, spoiled), None) == pytest.approx(w, rel=1e-6, abs=1e-9)   # 9 places sent


def test_measured_weight_says_nothing_rather_than_something_wrong():
    from worker.sizing import measured_weight
    assert measured_weight(Timed(1e-5, 1e-3), prior=1e-3) == pytest.approx(1e-3, rel=1e-6)
    assert measured_weight(Timed(1e-5, 1e-3), prior=1e-2) is None           # 10x off the FLOP model
    assert measured_weight(Timed(1e-5, 0.0), prior=None) is None             # a long row no dearer
    assert measured_weight(Timed(1e-5, 1e-3), prior=None, long=64) is None   # too short to tell


def test_attention_weight_is_the_flop_model_of_the_config():
    from types import SimpleNamespace
    from worker.sizing import attention_weight
    demo = SimpleNamespace(hidden_size=256, num_hidden_layers=24, num_attention_heads=4, head_dim=64,
                           num_key_value_heads=2, intermediate_size=512)
    linear = 2 * 24 * (256 * 64 * (4 + 4) + 4 * 64 * 256 + 3 * 256 * 512)
    assert attention_weight(demo) == pytest.approx(4 * 4 * 64 * 24 / linear, rel=1e-6)
    hybrid = SimpleNamespace(**vars(demo), layer_types=["linear_attention"] * 18 + ["full_attention"] * 6)
    assert attention_weight(hybrid) == pytest.approx(attention_weight(demo) / 4, rel=1e-6)
    assert attention_weight(SimpleNamespace()) is None


@given(cuts=st.lists(st.integers(11, 59), min_size=1, max_size=4))
def test_a_lease_cut_by_steals_is_sized_as_a_fresh_read_of_its_rows(token_data, cuts):
    """sizing.Sizer sizes a lease that steals cut short from the longer one it sized before, less
    the rows cut off: the same rows, tokens and tokens squared as reading the cut lease afresh."""
    from worker.events import EventLog
    from worker.sizing import Sizer, shard_work
    dataset, options = open_dataset(token_data), Options(max_length=30)
    log = EventLog(None, 0)
    sizer = Sizer(log, dataset, 500, "unused", options)
    stop = 60
    sizer.start([(0, 5), (10, stop)]).join()
    for cut in sorted(cuts, reverse=True):
        stop = min(stop, cut)
        sizer.start([(0, 5), (10, stop)]).join()
        fresh = [shard_work(dataset, a, b, 500, lambda: None, options) for a, b in ((0, 5), (10, stop))]
        assert log.total_tokens == sum(f[1] for f in fresh) > 0
        assert log.work["total_rows"] == sum(f[0] for f in fresh)
        assert log.work["total_sq_tokens"] == sum(f[2] for f in fresh)
