"""fleet.verify's merge of the hosts' reports."""

from __future__ import annotations

import asyncio

import pytest

from fleet.deploy import run_worker_module
from fleet.transport import Completed, HostUnusable, Transport
from tests.faults.test_hostile_inputs import local_toml
from worker.protocol import VerifyReport


def test_verify_merge_refuses_hosts_in_different_formats():
    from fleet.verify import merge_reports
    a = {"num_samples": 4, "format": "speculators", "written": [[0, 2]], "skipped": {}, "problems": []}
    b = {"num_samples": 4, "format": "eagle", "written": [[2, 3]], "skipped": {}, "problems": []}
    result = merge_reports({"box1": VerifyReport.from_dict(a), "box2": VerifyReport.from_dict(b)})
    assert result.problems == ["box2: files in format eagle, another host's in speculators"]
    assert result.missing == [[3, 4]] and not result.ok


class Replies(Transport):
    """A transport whose every command prints `stdout` (what a host replied) and succeeds."""

    def __init__(self, stdout: str):
        super().__init__(None)
        self.stdout = stdout

    async def run(self, argv, timeout=None, input=None) -> Completed:
        return Completed(0, self.stdout, "")


@pytest.mark.parametrize("stdout,says", [
    ('progress\n{"num_samples": 4, "written": [[0, 4]], "problems": []}\n', None),
    ('{"num_samples": "four"}', ": VerifyReport.num_samples: int expected, not 'four'"),
    ('{"written": [[0, 2], 7]}', ": VerifyReport.written[1]: a list expected, not 7"),
    ('{"repaired": {"dropped": "all"}}', ": VerifyReport.repaired.dropped: a list expected, not 'all'"),
    ('[1, 2]', ": VerifyReport: an object expected, not [1, 2]"),
    ('Traceback (most recent call last):', " printed no result: Traceback (most recent call last):"),
])
def test_a_reply_is_parsed_once_where_it_arrives_and_a_malformed_one_names_the_host(tmp_path, stdout, says):
    from fleet.config import load_config
    config = load_config(local_toml(tmp_path, '[run]\nname = "r"\nmodel = "m"\ndata = "d.jsonl"\noutput = "o"\n'))
    go = run_worker_module(Replies(stdout), config, config.hosts[0], "verify", reply=VerifyReport)
    if says is None:
        report = asyncio.run(go)
        assert isinstance(report, VerifyReport) and report.written == [[0, 4]] and report.repaired is None
        return
    with pytest.raises(HostUnusable) as e:
        asyncio.run(go)
    assert str(e.value) == f"local: worker.verify{says}" and "\n" not in str(e.value)


# --- repair removes only what is proven wrong or proven elsewhere (issue 53) ---------------------

import json
import os
import shutil

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROWS = 24


@pytest.fixture(scope="module")
def two_folders(tmp_path_factory, dense_model):
    """Two hosts' output folders of one run, written by the real worker: host a rows 0-11 (shard 0),
    host b rows 12-23 (shard 1), each with its pool's ledger."""
    from tests.conftest import run_worker
    from worker.demo import make_token_dataset
    root = tmp_path_factory.mktemp("repair")
    data = make_token_dataset(str(root / "d.jsonl"), ROWS, vocab_size=500, mean_tokens=12, seed=4)
    for k, host in enumerate("ab"):
        r = run_worker("--model", dense_model, "--data", data, "--out", str(root / host), "--state", str(root / f"s{k}"),
                       "--shard-index", str(k), "--num-shards", "2", "--pool", str(k), "--device", "cpu",
                       "--reference-checks", "0")
        assert r.returncode == 0, r.stderr
    return {host: str(root / host) for host in "ab"}


def sample_bytes(layout, folder: str, i: int) -> bytes | None:
    try:
        with open(layout.path(folder, i), "rb") as f:
            return f.read()
    except OSError:
        return None


def recorded(folder: str) -> set[int]:
    from worker.files import manifest_records
    return {r["index"] for r in manifest_records(folder)} if os.path.isdir(folder) else set()


damage = st.lists(st.one_of(
    st.tuples(st.just("copy_to_b"), st.integers(0, 11), st.integers(1, 6), st.sampled_from(["a", "zz"])),
    st.tuples(st.just("gone"), st.sampled_from("ab"), st.integers(0, ROWS - 1), st.integers(1, 8),
              st.sampled_from(["a", "b", "zz"])),
    st.tuples(st.just("delete_file"), st.sampled_from("ab"), st.integers(0, ROWS - 1)),
    st.tuples(st.just("drop_line"), st.sampled_from("ab"), st.integers(0, ROWS - 1)),
    st.tuples(st.just("dup_line"), st.sampled_from("ab"), st.integers(0, ROWS - 1)),
    st.tuples(st.just("wipe"), st.sampled_from("ab"))), max_size=6)


def apply(ops, folders: dict[str, str], layout) -> None:
    """Damage as it happens: a host's copies of another's rows with its ledger saying where they
    went (to the right host, or to one the run never had), ledger lines alone, files deleted,
    manifest lines dropped or doubled, a whole folder gone."""
    from worker.leases import Ledger
    from worker.writer import write_lines_atomic

    def manifest(host):
        return os.path.join(folders[host], "manifest", f"{'ab'.index(host)}.jsonl")

    def lines(host):
        return [l for l in open(manifest(host)).read().splitlines() if l.strip()] if os.path.exists(manifest(host)) else []

    def add_gone(host, a, b, to):
        from worker.leases import ledger_files
        [path] = ledger_files(folders[host]) or [None]
        if path is None:
            return
        ledger = Ledger.from_json(open(path).read())
        ledger.gone.append([a, min(b, ROWS), to])
        open(path, "w").write(ledger.to_json())
    for op in ops:
        kind, *args = op
        if kind == "copy_to_b" and os.path.isdir(folders["a"]) and os.path.isdir(folders["b"]):
            a, n, to = args
            rows = range(a, min(a + n, 12))
            mine = {json.loads(l)["index"]: l for l in lines("a")}
            for i in rows:
                if i in mine and (data := sample_bytes(layout, folders["a"], i)) is not None:
                    os.makedirs(os.path.dirname(layout.path(folders["b"], i)), exist_ok=True)
                    open(layout.path(folders["b"], i), "wb").write(data)
                    write_lines_atomic(manifest("b"), lines("b") + [mine[i]])
            add_gone("b", rows.start, rows.stop, to)
        elif kind == "gone" and os.path.isdir(folders[args[0]]):
            host, a, n, to = args
            add_gone(host, a, a + n, to)
        elif kind == "delete_file" and os.path.isdir(folders[args[0]]):
            try:
                os.unlink(layout.path(folders[args[0]], args[1]))
            except OSError:
                pass
        elif kind in ("drop_line", "dup_line") and os.path.isdir(folders[args[0]]):
            host, i = args
            old = lines(host)
            hit = [l for l in old if json.loads(l)["index"] == i]
            if hit:
                write_lines_atomic(manifest(host), [l for l in old if l not in hit] if kind == "drop_line" else old + hit[:1])
        elif kind == "wipe":
            shutil.rmtree(folders[args[0]], ignore_errors=True)


@settings(max_examples=int(os.environ.get("REPAIR_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=damage)
def test_after_any_repair_every_row_is_present_once_or_to_redo_and_no_correct_copy_is_lost(two_folders, tmp_path, ops):
    """Against an independent count — the rows whose file is byte-for-byte the one the worker wrote
    and that a manifest records, read straight from the folders — after fleet verify's repair (each
    host checked, moves confirmed where the other copy is whole, each host repaired): a row that had
    a correct recorded copy still has one, every row is present on one host or missing (redone by
    the next launch), and what verify counts present is there and correct."""
    from fleet.verify import merge_reports, moved_copies
    from worker.verify import check_folder, layout_of
    case = tmp_path / f"case-{abs(hash(tuple(ops))) % 10**9}"
    shutil.rmtree(case, ignore_errors=True)
    folders = {h: str(case / h) for h in "ab"}
    for h in "ab":
        shutil.copytree(two_folders[h], folders[h])
    layout = layout_of(json.load(open(os.path.join(two_folders["a"], "meta.json"))))
    golden = {i: sample_bytes(layout, two_folders["ab"[i >= 12]], i) for i in range(ROWS)}
    apply(ops, folders, layout)

    def correct(h: str, i: int) -> bool:
        return i in recorded(folders[h]) and sample_bytes(layout, folders[h], i) == golden[i]
    before = {i: {h for h in "ab" if correct(h, i)} for i in range(ROWS)}
    present = {h: f for h, f in folders.items() if os.path.isdir(f)}
    moved = moved_copies({h: check_folder(f) for h, f in present.items()})
    for h, f in present.items():
        check_folder(f, repair=True, confirmed=moved.extra[h], restore=moved.restore[h])
    after = {i: {h for h in "ab" if correct(h, i)} for i in range(ROWS)}
    result = merge_reports({h: check_folder(f) for h, f in present.items() if os.path.exists(os.path.join(f, "meta.json"))})
    missing = {i for a, b in result.missing for i in range(a, b)}
    for i in range(ROWS):
        assert not before[i] or after[i], (i, ops, before[i])                # a correct copy is never lost
    if result.num_samples is None:                                            # both meta.json gone: nothing counts
        return
    for i in range(ROWS):
        there = [h for h in "ab" if i in recorded(folders[h]) and correct(h, i)]
        assert (i in missing) != bool(after[i]), (i, ops, after[i], result.missing)   # present, or to redo
        assert i in missing or there, (i, ops)                               # present means there and correct
    assert not [p for p in result.problems if "present on" in p], (ops, result.problems)


def test_a_ledger_line_giving_rows_to_a_host_the_run_never_had_is_reported_never_acted_on(tmp_path, dense_model):
    """Issue 53's case: a `gone` line in a host's pool ledger naming host zz, which fleet.toml does
    not have. verify counts the copies here (they are the only ones), says why, and prints no
    training command; --repair removes no file and lifts the line; verify then passes."""
    import glob as globbing
    from tests.fleet.conftest import fleet
    from worker.demo import make_token_dataset
    from worker.leases import Ledger
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 60, vocab_size=500, mean_tokens=20, seed=9)
    config = local_toml(tmp_path, f'[run]\nname = "zz"\nmodel = "{dense_model}"\ndata = "{data}"\noutput = "out"\n'
                                  f'device = "cpu"\nmax_tokens_per_batch = 512\nreference_checks = "off"\n')
    assert fleet("up", "--headless", "-c", config, timeout=300).returncode == 0
    files = lambda: sorted(globbing.glob(str(tmp_path / "out" / "hs_*.safetensors")))  # noqa: E731
    assert len(files()) == 60
    [path] = globbing.glob(str(tmp_path / "out" / ".fleet" / "leases-*.json"))
    ledger = Ledger.from_json(open(path).read())
    ledger.done = []
    ledger.gone = [[0, 60, "zz"]]
    open(path, "w").write(ledger.to_json())
    v = fleet("verify", "-c", config)
    assert v.returncode == 1 and "60 written" in v.stdout, v.stdout + v.stderr
    assert "60 sample(s) here (0-59) are marked moved to zz, which is not a host of the run" in v.stdout, v.stdout
    assert "this copy counts; --repair keeps it and lifts that ledger line" in v.stdout
    assert "missing" not in v.stdout
    r = fleet("verify", "--repair", "-c", config)
    assert len(files()) == 60, r.stdout + r.stderr                     # not one correct file removed
    v = fleet("verify", "-c", config)
    assert v.returncode == 0 and "verify: OK" in v.stdout and "60 written" in v.stdout, v.stdout + v.stderr
    assert len([l for l in v.stdout.splitlines() if l.startswith("train (")]) == 1
    assert Ledger.from_json(open(path).read()).gone == []
