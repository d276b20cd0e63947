"""Leases of rows among a host's shards (worker/leases.py): the ledger's invariants under any
sequence of finishes, deaths, steals and restarts, and real worker processes sharing one host's
rows — a dead GPU's finished by the others, a slow GPU's tail split — every row exactly once."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.leases import Ledger
from worker.ranges import to_runs
from worker.verify import check_folder, verify
from tests.conftest import REPO, read_events, wait_for

INJECT = os.path.join(REPO, "tests", "faults", "inject")


# --- the ledger under any sequence of steps ----------------------------------------------------

def planned(sizes: list[int]) -> dict[int, tuple[int, int]]:
    out, a = {}, 0
    for k, n in enumerate(sizes):
        out[k] = (a, a + n)
        a += n
    return out


steps = st.lists(st.tuples(st.sampled_from(["finish", "die", "revive", "read", "act", "answer", "reload", "repair",
                                            "adopt", "revoke", "complete"]),
                           st.integers(0, 5), st.integers(0, 60), st.integers(0, 30)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=6), script=steps)
def test_every_row_is_held_once_and_no_done_row_is_held_again(sizes, script):
    """The ledger against a model kept beside it from the moves it returns alone: after every
    step, each shard's rows in the ledger are the rows the model says it was given, every row is
    held by at most one shard, held, done, free (adopted from a lost host) and gone (moved to
    another host) cover the pool's rows and the adopted ones, and no done row is held again."""
    ranges = planned(sizes)
    slots = sorted(ranges)
    ledger = Ledger.planned(ranges)
    model = {k: set(range(*ranges[k])) for k in slots if ranges[k][1] > ranges[k][0]}   # shard -> rows
    done: set[int] = set()
    free: set[int] = set()
    gone: set[int] = set()
    accounted = {i for a, b in ranges.values() for i in range(a, b)}
    alive = set(slots)
    for op, k, n, m in script:
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
        elif op == "complete" and k in ledger.held and k in alive:    # a [job]'s chunk of n rows finished
            lease = ledger.held[k]
            first = set(range(lease.start, min(lease.start + n, lease.stop)))
            ledger.complete(k, lease.start + n)
            assert first <= model[k]
            model[k] -= first
            done |= first
        elif op == "act" and k not in ledger.held and k in alive:
            choice = ledger.victim(k, lambda s: s in alive)
            if choice is not None and choice[0] == "dead":
                move = ledger.take_over(k, choice[1])
                model[k] = model.pop(move.source)
                assert (move.start, move.stop) == ((min(model[k]), max(model[k]) + 1) if model[k] else
                                                   (move.start, move.start))
            elif choice is not None and choice[0] == "steal":
                ledger.ask(k, choice[1], 0.0)
            elif choice is not None and choice[0] == "free":
                move = ledger.take_free(k)
                model[k] = set(range(move.start, move.stop))
                assert model[k] <= free and (move.how, move.origin) in (("adopted", "lost"), ("freed", None))
                free -= model[k]
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
        elif op == "adopt":                          # rows of a lost host (some maybe ours already)
            rows = set(range(n, n + m))
            ledger.adopt([(n, n + m)], "lost")
            new = rows - done - free - {i for r in model.values() for i in r}
            free |= new
            gone -= new
            accounted |= rows
        elif op == "revoke":                         # this host was lost: rows n..n+m went elsewhere
            rows = set(range(n, n + m))
            stopped = ledger.revoke([(n, n + m)], "other")
            assert set(stopped) == {s for s, r in model.items() if r & rows}
            for s in stopped:
                free |= model.pop(s) - rows
            done -= rows
            free -= rows
            gone |= rows
            accounted |= rows
        assert ledger.problems(to_runs(accounted)) == []
        assert ledger.check(max(accounted, default=0) + 1) is None      # what every reader checks: no false alarm
        held = {s: set(range(l.start, l.stop)) for s, l in ledger.held.items()}
        assert {s: r for s, r in held.items() if r} == {s: r for s, r in model.items() if r}
        assert not any(r & done for r in held.values())
        assert {i for a, b, _ in ledger.done for i in range(a, b)} == done
        assert {i for a, b, _ in ledger.free for i in range(a, b)} == free
        assert {i for a, b, _ in ledger.gone for i in range(a, b)} == gone


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
    # Either shard, once dry, may steal part of what the other holds, before or after the takeover,
    # either way (a loaded machine times it so): each one's total is its 80 planned rows, plus the
    # rows it was leased (dead or stolen), less the rows that moved away from it — by its events.
    def by_events(k: int) -> int:
        evs = shard_events(tmp_path, k)
        return (80 + sum(e["rows"] for e in evs if e["event"] == "leased" and e["how"] in ("dead", "stolen"))
                - sum(e["rows"] for e in evs if e["event"] == "lease_moved"))
    assert all(d["done"] == d["total"] for d in done.values())
    assert {k: d["total"] for k, d in done.items()} == {k: by_events(k) for k in (0, 1)}
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


# --- rows moved between hosts, carried out on real workers (worker/relocate.py) ----------------

def start_pool(tmp_path, model: str, data: str, members: list[int], num_shards: int) -> dict[int, subprocess.Popen]:
    return {k: subprocess.Popen(
        [sys.executable, "-m", "worker.extract", "--model", model, "--data", data,
         "--out", str(tmp_path / "out"), "--state", str(tmp_path / "run" / "shards" / str(k)),
         "--shard-index", str(k), "--num-shards", str(num_shards), "--pool", ",".join(map(str, members)),
         "--model-dtype", "fp32", "--max-tokens-per-batch", "256", "--device", "cpu", "--progress-interval", "0.2"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": str(k), "OMP_NUM_THREADS": "1"}) for k in members}


def relocate(tmp_path, cmd: str, rows: str, num_shards: int, pool: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "worker.relocate", cmd, "--out", str(tmp_path / "out"),
                        "--run-dir", str(tmp_path / "run"), "--num-shards", str(num_shards), "--pool", pool,
                        "--rows", rows, "--from-host", "lost" if cmd == "adopt" else "here",
                        "--to-host", "here" if cmd == "adopt" else "other"],
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_rows_adopted_while_the_pool_runs_are_done_by_it_once(tmp_path, dense_model):
    """Shards 0 and 1 of 3 on this host; shard 2's host is lost and its rows adopted mid-run: the
    two finish all 600 rows, each once, and say where the adopted ones came from."""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 600, vocab_size=500, mean_tokens=30, seed=12)
    procs = start_pool(tmp_path, dense_model, data, [0, 1], 3)
    wait_for(lambda: os.path.exists(tmp_path / "out" / "meta.json"), 180, what="the model loaded")
    assert relocate(tmp_path, "adopt", "400-599", 3, "0,1")["status"] == "adopted"
    assert relocate(tmp_path, "adopt", "400-599", 3, "0,1")["status"] == "already"      # a retry adds nothing
    assert {k: p.wait(timeout=600) for k, p in procs.items()} == {0: 0, 1: 0}
    assert manifest_counts(str(tmp_path / "out")) == {i: 1 for i in range(600)}
    assert verify(str(tmp_path / "out"))["problems"] == []
    adopted = [e for k in (0, 1) for e in shard_events(tmp_path, k) if e["event"] == "leased" and e["how"] == "adopted"]
    assert adopted and all(e["from_host"] == "lost" for e in adopted) and adopted[0]["start"] == 400
    told = [e for e in shard_events(tmp_path, 0) if e["event"] == "relocated"]
    assert [(e["start"], e["stop"], e["side"]) for e in told] == [(400, 600, "in")]
    done = [next(e for e in shard_events(tmp_path, k) if e["event"] == "done") for k in (0, 1)]
    assert sum(d["done"] for d in done) == 600 and sum(d["total"] for d in done) == 600


def test_rows_revoked_from_a_host_back_from_lost_stop_its_running_shards_and_its_copies_go(tmp_path, dense_model):
    """The host was lost and its rows moved on; it comes back with its shards still running: they
    stop those rows at their next look (exit 0, holding none), and `--repair` removes what they
    wrote once told the other host holds those rows whole (fleet verify checks it there), so the
    folder holds none of them — and not one before it is told (issue 53)."""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 3000, vocab_size=500, mean_tokens=40, seed=13)
    procs = start_pool(tmp_path, dense_model, data, [0, 1], 2)
    wait_for(lambda: sum(manifest_counts(str(tmp_path / "out")).values()) >= 30 if (tmp_path / "out" / "manifest").exists()
             else False, 180, what="rows written")
    assert relocate(tmp_path, "revoke", "0-2999", 2, "0,1")["status"] == "revoked"
    assert {k: p.wait(timeout=600) for k, p in procs.items()} == {0: 0, 1: 0}
    written = len(manifest_counts(str(tmp_path / "out")))
    assert 0 < written < 3000                              # stopped short, not run to the end
    for k in (0, 1):
        events = shard_events(tmp_path, k)
        assert any(e["event"] == "warning" and "no longer this shard's" in e["message"] for e in events)
        assert next(e for e in events if e["event"] == "done")["total"] == 0
        assert [(e["start"], e["stop"], e["to_host"]) for e in events if e["event"] == "relocated"] == [(0, 3000, "other")]
    report = verify(str(tmp_path / "out"))
    assert report["written"] == [] and any("moved to other while this host was lost" in p for p in report["problems"])
    unconfirmed = check_folder(str(tmp_path / "out"), repair=True).to_dict()
    assert unconfirmed["repaired"] is None and len(manifest_counts(str(tmp_path / "out"))) == written
    repaired = check_folder(str(tmp_path / "out"), repair=True, confirmed=set(range(3000))).to_dict()
    assert repaired["problems"] == [] and repaired["repaired"]["moved_away"] and repaired["unrecorded_files"] == 0
    assert manifest_counts(str(tmp_path / "out")) == {}
    assert not glob.glob(str(tmp_path / "out" / "*.safetensors"))


def test_a_ledger_that_says_what_cannot_be_is_refused_naming_the_entry(tmp_path):
    """Issue 53: a ledger is input like any other file on a disk. Each kind of lie is refused by
    the one door (open_ledger) with one line naming the file and the entry: never an assertion
    further on, a wait for ever, or rows claimed done that then nobody does."""
    from worker.leases import Lease, LedgerError, open_ledger
    ranges = {0: (0, 50), 1: (50, 100)}
    path = str(tmp_path / ".fleet" / "leases-0.json")
    cases = {
        "past the end": (lambda l: l.held.__setitem__(0, Lease(0, 10**9, 1, 0)),
                         "held lease of shard 0: rows 0–1000000000 are not within the dataset's 100 rows"),
        "backwards": (lambda l: l.done.append([60, 55, 1]), "done [60, 55, 1]: rows 60–55 are not within"),
        "epoch ahead": (lambda l: setattr(l.held[1], "epoch", 99),
                        "held lease of shard 1: epoch 99 is past the ledger's 2 (epochs only grow)"),
        "twice": (lambda l: l.free.append([40, 60, "x"]), "free [40, 60, x]: rows 40–50 are also in held lease of shard 0"),
        "rows lost": (lambda l: l.held.pop(1), "rows 50–100 of the pool's plan are in no entry"),
    }
    for name, (lie, says) in cases.items():
        ledger = Ledger.planned(ranges)
        lie(ledger)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").write(ledger.to_json())
        try:
            with open_ledger(path, ranges, 100):
                pass
        except LedgerError as e:
            assert str(e).startswith(f"{path}: ") and says in str(e) and "\n" not in str(e), (name, str(e))
        else:
            raise AssertionError(f"{name}: taken")
    open(path, "w").write("{not json")
    try:
        with open_ledger(path, ranges, 100):
            pass
    except LedgerError as e:
        assert "not a ledger" in str(e)
    else:
        raise AssertionError("garbage taken")
    ledger = Ledger.planned(ranges)                       # and a true one is taken
    open(path, "w").write(ledger.to_json())
    with open_ledger(path, ranges, 100) as read:
        assert read.held == ledger.held


def test_a_lease_past_the_dataset_ends_the_shard_fatal_in_one_line_and_the_run_ends(tmp_path, dense_model):
    """The issue's first case through the real worker: rows 0–10**9 in the ledger. The shard fails
    FATAL at once naming the file and the entry (no AssertionError, no LOADING for ever), and every
    shard of the pool does the same, so the run ends instead of hanging."""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 40, vocab_size=500, mean_tokens=20, seed=3)
    ledger = Ledger.planned({0: (0, 20), 1: (20, 40)})
    ledger.held[0].stop = 10**9
    os.makedirs(tmp_path / "out" / ".fleet")
    (tmp_path / "out" / ".fleet" / "leases-0.json").write_text(ledger.to_json())
    procs = start_pool(tmp_path, dense_model, data, [0, 1], 2)
    assert {k: p.wait(timeout=300) for k, p in procs.items()} == {0: 1, 1: 1}
    for k in (0, 1):
        [failed] = [e for e in shard_events(tmp_path, k) if e["event"] == "failed"]
        assert failed["fatal"] is True and "leases-0.json: held lease of shard 0: rows 0–1000000000 are not " \
            "within the dataset's 40 rows" in failed["reason"] and "\n" not in failed["reason"], failed
        assert "Traceback" not in failed["reason"] and not [e for e in shard_events(tmp_path, k) if e["event"] == "loaded"]


def test_a_ledger_claiming_rows_done_that_no_manifest_holds_has_them_done(tmp_path, dense_model):
    """The issue's second case: a well-formed ledger saying every row is done, in several entries,
    over an empty output. The pool does them all (not only the first entry), so the run is
    finished with every row written."""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 60, vocab_size=500, mean_tokens=20, seed=4)
    ledger = Ledger.planned({0: (0, 30), 1: (30, 60)})
    ledger.held = {}
    ledger.done = [[a, a + 10, a // 30] for a in range(0, 60, 10)]
    os.makedirs(tmp_path / "out" / ".fleet")
    (tmp_path / "out" / ".fleet" / "leases-0.json").write_text(ledger.to_json())
    procs = start_pool(tmp_path, dense_model, data, [0, 1], 2)
    assert {k: p.wait(timeout=300) for k, p in procs.items()} == {0: 0, 1: 0}
    assert sorted(manifest_counts(str(tmp_path / "out"))) == list(range(60))
    assert set(manifest_counts(str(tmp_path / "out")).values()) == {1}
