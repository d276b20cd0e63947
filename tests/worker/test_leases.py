"""Leases of rows among a host's shards (worker/leases.py): the ledger's invariants under any
sequence of finishes, deaths, steals and restarts, and real worker processes sharing one host's
rows — a dead GPU's finished by the others, a slow GPU's tail split — every row exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.leases import Ledger
from worker.verify import verify
from tests.conftest import REPO, read_events

INJECT = os.path.join(REPO, "tests", "faults", "inject")


# --- the ledger under any sequence of steps ----------------------------------------------------

def planned(sizes: list[int]) -> dict[int, tuple[int, int]]:
    out, a = {}, 0
    for k, n in enumerate(sizes):
        out[k] = (a, a + n)
        a += n
    return out


steps = st.lists(st.tuples(st.sampled_from(["finish", "die", "revive", "read", "act", "answer", "reload", "repair"]),
                           st.integers(0, 5), st.integers(0, 60)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6), script=steps)
def test_every_row_is_held_once_and_no_done_row_is_held_again(sizes, script):
    """The ledger against a model kept beside it from the moves it returns alone: after every
    step, each shard's rows in the ledger are the rows the model says it was given, every row is
    held by at most one shard, held and done cover the pool, and done rows only grow."""
    ranges = planned(sizes)
    slots = sorted(ranges)
    ledger = Ledger.planned(ranges)
    model = {k: set(range(*ranges[k])) for k in slots if ranges[k][1] > ranges[k][0]}   # shard -> rows
    done: set[int] = set()
    alive = set(slots)
    for op, k, n in script:
        k = slots[k % len(slots)]
        if op == "finish" and k in ledger.held and k in alive:
            ledger.finish(k)
            done |= model.pop(k)
        elif op == "die":
            alive.discard(k)
        elif op == "revive":
            alive.add(k)
        elif op == "read" and k in ledger.held:
            lease = ledger.held[k]
            ledger.read_up_to(k, lease.start + n)
        elif op == "act" and k not in ledger.held and k in alive:
            choice = ledger.victim(k, lambda s: s in alive)
            if choice is not None and choice[0] == "dead":
                move = ledger.take_over(k, choice[1])
                model[k] = model.pop(move.source)
                assert (move.start, move.stop) == (min(model[k]), max(model[k]) + 1)
            elif choice is not None and choice[0] == "steal":
                ledger.ask(k, choice[1], 0.0)
        elif op == "answer" and k in ledger.steals and k in alive:
            lease = ledger.held[k]
            move = ledger.answer(k, lease.start + n)
            if move is not None:
                given = set(range(move.start, move.stop))
                assert given <= model[k] and move.start >= min(lease.start + n, move.stop)
                model[k] -= given
                model[move.target] = given
        elif op == "repair" and k not in ledger.held and k in alive:   # verify --repair dropped row n
            move = ledger.reopen(k, lambda a, b: a <= n < b)
            if move is not None:
                model[k] = set(range(move.start, move.stop))
                assert n in model[k] and model[k] <= done
                done -= model[k]
        elif op == "reload":                         # a supervisor or worker restart reads it back
            ledger = Ledger.from_json(ledger.to_json())
        assert ledger.problems([ranges[s] for s in slots]) == []
        held = {s: set(range(l.start, l.stop)) for s, l in ledger.held.items()}
        assert {s: r for s, r in held.items() if r} == {s: r for s, r in model.items() if r}
        assert not any(r & done for r in held.values())
        assert {i for a, b, _ in ledger.done for i in range(a, b)} == done


# --- real workers sharing one host's rows ------------------------------------------------------

def run_pool(tmp_path, model: str, data: str, slots: int, env: dict[str, str]) -> dict[int, int]:
    """`slots` worker processes of one pool on the CPU, each as fleet launches it on its GPU
    (CUDA_VISIBLE_DEVICES = its index); their exit codes."""
    procs = {}
    for k in range(slots):
        procs[k] = subprocess.Popen(
            [sys.executable, "-m", "worker.extract", "--model", model, "--data", data,
             "--out", str(tmp_path / "out"), "--state", str(tmp_path / "run" / "shards" / str(k)),
             "--shard-index", str(k), "--num-shards", str(slots), "--pool", ",".join(map(str, range(slots))),
             "--model-dtype", "fp32", "--max-tokens-per-batch", "256", "--device", "cpu", "--progress-interval", "0.2"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": f"{REPO}:{INJECT}", "CUDA_VISIBLE_DEVICES": str(k),
                 "OMP_NUM_THREADS": "1", **env})
    return {k: p.wait(timeout=600) for k, p in procs.items()}


def manifest_counts(out: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    folder = os.path.join(out, "manifest")
    for name in os.listdir(folder):
        for line in open(os.path.join(folder, name)):
            if line.strip():
                i = json.loads(line)["index"]
                counts[i] = counts.get(i, 0) + 1
    return counts


def shard_events(tmp_path, k: int) -> list[dict]:
    return read_events(str(tmp_path / "run" / "shards" / str(k)))


def test_a_dead_gpus_rows_are_finished_by_the_others_exactly_once(tmp_path, dense_model):
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 240, vocab_size=500, mean_tokens=30, seed=4)
    codes = run_pool(tmp_path, dense_model, data, 3, {"FLEET_INJECT_DEAD_GPU": "2"})
    assert codes[0] == codes[1] == 0 and codes[2] != 0
    assert manifest_counts(str(tmp_path / "out")) == {i: 1 for i in range(240)}
    assert verify(str(tmp_path / "out"))["problems"] == []
    moved = [e for e in shard_events(tmp_path, 2) if e["event"] == "lease_moved"]
    assert [(e["start"], e["stop"], e["why"], e["holds"]) for e in moved] == [(160, 240, "dead", False)]
    takers = [(k, e) for k in (0, 1) for e in shard_events(tmp_path, k)
              if e["event"] == "leased" and e["how"] == "dead"]
    assert [(e["start"], e["stop"], e["from_shard"], e["rows"]) for _, e in takers] == [(160, 240, 2, 80)]
    taker = takers[0][0]
    done = {k: next(e for e in shard_events(tmp_path, k) if e["event"] == "done") for k in (0, 1)}
    assert done[taker]["done"] == done[taker]["total"] == 160 and done[1 - taker]["total"] == 80
    assert sum(d["done"] for d in done.values()) == 240


def test_a_slow_gpus_last_rows_are_split_off_and_done_once(tmp_path, dense_model):
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 600, vocab_size=500, mean_tokens=20, seed=6)
    codes = run_pool(tmp_path, dense_model, data, 3, {"FLEET_INJECT_SLOW_GPU": "2:0.3"})
    assert codes == {0: 0, 1: 0, 2: 0}
    assert manifest_counts(str(tmp_path / "out")) == {i: 1 for i in range(600)}
    assert verify(str(tmp_path / "out"))["problems"] == []
    given = [e for e in shard_events(tmp_path, 2) if e["event"] == "lease_moved"]
    assert given and all(e["why"] == "stolen" and e["holds"] for e in given)
    stolen = [e for k in (0, 1) for e in shard_events(tmp_path, k) if e["event"] == "leased" and e["how"] == "stolen"]
    assert sorted((e["start"], e["stop"]) for e in stolen if e["from_shard"] == 2) == \
        sorted((e["start"], e["stop"]) for e in given)
    done = {k: next(e for e in shard_events(tmp_path, k) if e["event"] == "done") for k in range(3)}
    assert done[2]["total"] == 200 - sum(e["stop"] - e["start"] for e in given)
    assert sum(d["done"] for d in done.values()) == 600
