"""Rows of a lost host go to the live ones (fleet/relocate.py, worker/relocate.py): the split and
the orders as pure functions, and two real hosts over two real sshds, one cut off for longer than
`host_lost_after` and then back — every row written once in the end, the lost host told first."""

from __future__ import annotations

import contextlib
import glob
import json
import os

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.relocate import HostFacts, Moves, Order, orders, split
from tests.conftest import read_events, wait_for
from tests.fleet.conftest import LOST_AFTER, fleet, hosts_toml, lose_host, two_hosts, up_headless
from tests.fleet.test_destination import with_env
from tests.s3_store import S3Store
from tests.sshd_server import serve
from worker import protocol
from worker.leases import merge


# --- the decision, pure ------------------------------------------------------------------------

runs_st = st.lists(st.tuples(st.integers(0, 500), st.integers(1, 60)), min_size=1, max_size=6).map(
    lambda xs: merge([(a, a + n) for a, n in xs]))


@settings(max_examples=300, deadline=None)
@given(runs=runs_st, weights=st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 8), min_size=1))
def test_a_lost_hosts_rows_are_split_among_the_others_whole_and_by_their_shards(runs, weights):
    """Every row goes to exactly one host, in contiguous pieces, each host's share within one row
    of its shards' part of the whole (counted independently from the weights)."""
    parts = split(runs, weights)
    given_rows = sorted(i for r in parts.values() for a, b in r for i in range(a, b))
    assert given_rows == sorted(i for a, b in runs for i in range(a, b))
    total, rows = sum(weights.values()), sum(b - a for a, b in runs)
    for name, w in weights.items():
        share = sum(b - a for a, b in parts.get(name, []))
        assert abs(share - rows * w / total) <= 1


def facts(name, shards, lost=False, usable=True, had_work=True, planned=()):
    return HostFacts(name, tuple(shards), lost, usable, had_work, 10, tuple(planned))


def test_a_lost_host_with_work_is_adopted_and_told_first_when_back():
    moves = Moves()
    hosts = [facts("a", [0, 1], planned=[(0, 100)]), facts("b", [2, 3], lost=True, usable=False, planned=[(100, 200)]),
             facts("c", [4, 5, 6, 7], planned=[(200, 400)])]
    due = orders(hosts, moves)
    assert [(o.kind, o.host, o.from_host) for o in due] == [("adopt", "a", "b"), ("adopt", "c", "b")]
    assert sorted(r for o in due for r in o.runs) == [(100, 133), (133, 200)]
    for o in due:
        moves.ask(o, 1.0)
    assert orders(hosts, moves) == []                       # asked once, not again while it is under way
    assert moves.in_flight                                  # the run cannot be finished meanwhile
    for o in due:                                           # the receivers' records say so
        for a, b in o.runs:
            moves.seen(protocol.Relocated(start=a, stop=b, from_host="b", to_host=o.to_host, side="in", t=2.0))
    assert orders(hosts, moves) == [] and moves.rows == 100 and not moves.in_flight
    back = [hosts[0], facts("b", [2, 3], planned=[(100, 200)]), hosts[2]]
    revokes = orders(back, moves)
    assert [(o.kind, o.host, o.to_host, o.runs) for o in revokes] == \
        [("revoke", "b", "a", ((100, 133),)), ("revoke", "b", "c", ((133, 200),))]
    for o in revokes:
        moves.seen(protocol.Relocated(start=o.runs[0][0], stop=o.runs[0][1], from_host="b", to_host=o.to_host,
                                      side="out", t=3.0))
    assert orders(back, moves) == [] and moves.moved_to("b", 0.5) == "c" and moves.moved_to("b", 5.0) is None


def test_nothing_moves_without_a_receiver_or_from_a_host_that_had_finished():
    assert orders([facts("a", [0], lost=True, usable=False, planned=[(0, 9)])], Moves()) == []
    assert orders([facts("a", [0], planned=[(0, 9)]),
                   facts("b", [1], lost=True, usable=False, had_work=False, planned=[(9, 18)])], Moves()) == []
    refused = Moves()
    o = Order("adopt", "a", ((9, 18),), "b", "a")
    refused.ask(o, 1.0)
    refused.withdraw(o)
    assert not refused.in_flight
    assert orders([facts("a", [0], planned=[(0, 9)]), facts("b", [1], lost=True, usable=False, planned=[(9, 18)])],
                  refused) == [o.__class__("adopt", "a", ((9, 18),), "b", "a", redone=10)]


# --- two real hosts, one lost and back ---------------------------------------------------------

ROWS = 1200     # b's half (two shards of 300 rows) is far from done when it is cut off, 20 rows in: it was
                # 2,400 (and 40 rows in), which cost CI 200 s over both cases and proved nothing more

def manifest_counts(out: str) -> dict[int, int]:
    counts: dict[int, int] = {}
    for p in glob.glob(os.path.join(out, "manifest", "*.jsonl")):
        for line in open(p):
            if line.strip():
                i = json.loads(line)["index"]
                counts[i] = counts.get(i, 0) + 1
    return counts


@pytest.mark.parametrize("shipped", [False, True], ids=["on-the-hosts", "at-a-store"])
def test_a_lost_hosts_rows_are_finished_by_the_other_and_its_copies_removed_once_it_is_back(
        tmp_path, dense_model, shipped):
    """Also with the output shipped to one store: there too every row is counted once (the
    pools' ledgers shipped beside the manifests say which rows moved), and --repair mends it."""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), ROWS, vocab_size=500, mean_tokens=40, seed=21)
    store = S3Store(str(tmp_path / "store")).start() if shipped else None
    with two_hosts(tmp_path) as (servers, procs), contextlib.ExitStack() as stack:
        if store is not None:
            stack.callback(store.kill)
        config = hosts_toml(tmp_path, servers, model=dense_model, data=data, gpus={"a": [0, 1], "b": [0, 1]},
                            output=str(tmp_path / "remote" / "out-{host}"), supervise=LOST_AFTER,
                            extra_run='destination = "s3://bucket/run"\nkeep_local = "2MB"' if shipped else "")
        if store is not None:
            with_env(config, store.env(credentials_file=str(tmp_path / "aws-credentials")))
        out = {name: str(tmp_path / "remote" / f"out-{name}") for name in ("a", "b")}
        up, lines = up_headless(config)
        try:
            wait_for(lambda: len(manifest_counts(out["b"])) >= 20, 240, what="host b writing")
            lose_host(tmp_path, procs, "b", (2, 3))
            shards_b = tmp_path / "root-b" / "t" / "shards"
            written_on_b = len(manifest_counts(out["b"]))
            assert up.wait(400) == 0, "\n".join(lines)
        finally:
            if up.poll() is None:
                up.kill()
        text = "\n".join(lines)
        assert "rows 600–1,200 of b (lost) → a (600 rows)" in text, text
        assert "of b (lost) → a:" in text, text          # a shard of a took them: a line in the log view
        # every row is on a, once; the run finished with b still gone
        assert manifest_counts(out["a"]) == {i: 1 for i in range(ROWS)}, text
        r = fleet("status", "--json", "-c", config)
        snap = json.loads(r.stdout)
        assert r.returncode == 3 and snap["totals"]["finished"] is True, r.stdout + r.stderr
        assert snap["totals"]["rows_relocated"] == ROWS // 2 and 0 < snap["totals"]["rows_redone"] <= written_on_b
        shards = {s["id"]: s for s in snap["shards"]}
        assert all(shards[k]["state"] == "UNKNOWN" and not shards[k]["holds_rows"] and "went to a" in shards[k]["lease"]
                   for k in (2, 3))
        assert sum(shards[k]["rows_moved_in"] for k in (0, 1)) >= ROWS // 2

        procs["b"] = serve(servers["b"])              # b is back, with what it wrote before
        r = fleet("up", "--headless", "-c", config, timeout=400)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "b: back; its rows 600–1,200 went to a" in r.stderr + r.stdout
        for k in (2, 3):                               # told on each of its shards, and holding nothing
            events = read_events(str(shards_b / str(k)))
            assert [(e["start"], e["stop"], e["to_host"]) for e in events if e["event"] == "relocated"] == \
                [(ROWS // 2, ROWS, "a")]
        snap = json.loads(fleet("status", "--json", "-c", config).stdout)
        assert [s["state"] for s in snap["shards"]] == ["DONE"] * 4 and snap["totals"]["finished"]
        v = fleet("verify", "-c", config)
        assert v.returncode == 1 and "moved to a while this host was lost" in v.stdout, v.stdout + v.stderr
        v = fleet("verify", "--repair", "-c", config)
        assert "copies of rows another host holds now" in v.stdout, v.stdout + v.stderr
        v = fleet("verify", "-c", config)
        assert v.returncode == 0 and f"{ROWS} written" in v.stdout, v.stdout + v.stderr
        assert manifest_counts(out["b"]) == {}
        assert not [p for p in glob.glob(os.path.join(out["b"], "**", "*.safetensors"), recursive=True)]
        if store is not None:                          # one copy of each row at the store, as a recorded
            at = store.files("run")
            assert len([k for k in at if k.startswith("hs_")]) == ROWS
            assert manifest_counts(store.bucket_dir("run")) == {i: 1 for i in range(ROWS)}
