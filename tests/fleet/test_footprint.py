"""The output's footprint before it bites: preflight's projection from the dataset's real lengths,
each host's share against its free disk, the refusal and `--allow-partial` through the real
`fleet up` on a local host whose output is a small tmpfs; the disk-full forecast from the bytes
per token actually written."""

from __future__ import annotations

import json
import os
import subprocess


from fleet.config import ExpectedSpec
from fleet.footprint import Need, bytes_in, needs, verdicts
from fleet.record import fold
from fleet.schema import Disk
from fleet.snapshot import build_snapshot
from fleet.hosts import Host
from tests.faults.test_hostile_inputs import local_toml
from tests.faults.test_worker_faults import small_tmpfs  # noqa: F401  (fixture)
from tests.fleet.conftest import fleet
from tests.fleet.test_judge import launch, view
from worker import protocol as p
from worker.files import manifest_records
from worker.verify import verify


def footprint(rows: int, per_row: list[float]) -> p.Footprint:
    edges = list(range(rows + 1))
    return p.Footprint(rows=rows, edges=edges, remaining=per_row, bytes_per_token=2, bytes_per_token_fp8=1)


def test_each_host_needs_the_rows_of_its_shards_and_a_shared_folder_sums_them():
    fp = footprint(8, [100, 100, 100, 100, 0, 0, 0, 800])       # rows 4-6 already written
    assert bytes_in(fp, 0, 8) == 1200 and bytes_in(fp, 4, 8) == 800
    coarse = p.Footprint(rows=8, edges=[0, 4, 8], remaining=[400, 800])
    assert bytes_in(coarse, 2, 6) == 200 + 400                   # a cut bucket counts pro rata
    reports = {"a": p.PreflightReport(footprint=fp, free_bytes=500), "b": p.PreflightReport(footprint=fp, free_bytes=500)}
    outputs = {"a": "/o", "b": "/o"}
    groups = needs(reports, outputs, {"a": [0, 1], "b": [2, 3]}, 4)       # 2 rows a shard
    assert [(g.hosts, g.need, g.fp8_need, g.fits) for g in groups] == \
        [(["a"], 400, 200, True), (["b"], 800, 400, False)]
    refusals, warnings = verdicts(groups, allow_partial=False)
    assert refusals == ['b: output /o needs 800 B more for shard(s) 2-3, 500 B free; dtype = "fp8" needs '
                        'about 400 B; `fleet up --allow-partial` runs until the disk is full'] and warnings == []
    refusals, warnings = verdicts(groups, allow_partial=True)
    assert refusals == [] and any("stops when the disk is full" in w for w in warnings)
    # One folder on a shared file system (the same folder_id): one free space for both.
    for r in reports.values():
        r.folder_id = "f1"
    [shared] = needs(reports, outputs, {"a": [0, 1], "b": [2, 3]}, 4)
    assert (shared.hosts, shared.need, shared.free, shared.fits) == (["a", "b"], 1200, 500, False)
    # Close to full: a warning, not a refusal.
    refusals, warnings = verdicts([Need(["c"], "/o", [0], need=90_000_000, free=100_000_000)], False)
    assert refusals == [] and warnings == ["c: output /o needs 90.00 MB more of 100.00 MB free"]


def test_the_disk_full_forecast_uses_the_bytes_per_token_written():
    hosts = {"a": Host("a", "1.1.1.1", reachable=True, replayed=True,
                           disk=Disk(path="/o", free=0, total=10**12))}
    # 100 samples of 100 tokens written at 2,000 bytes per token (fp8, 4 x 496 + ids), 900 to go.
    evs = [launch(0), p.Loaded(t=1, launch=1)] + [
        p.Progress(t=t, launch=1, done=10 * t, tokens=1000 * t, bytes=2_000_000 * t, total=1000) for t in range(1, 11)]
    exp = ExpectedSpec()
    views = [view(0, "a", evs, 10)]
    left = 900 * 100 * 2000                                    # bytes the rest will write
    for free, expect in ((left, None), (left - 1, (left - 1) / (1000 * 2000))):
        hosts["a"].disk = Disk(path="/o", free=free, total=10**12)
        totals = build_snapshot("r", views, hosts, now=10, expected=exp).totals
        assert totals.disk_full_eta_s == (round(expect) if expect else None), free
    assert fold(evs).bytes / fold(evs).tokens == 2000


def manifest_bytes(out: str) -> int:
    """Through the worker's own reader: a disk that filled mid-append leaves a torn last line, which
    the worker passes over (its row is redone) — a plain json.loads of every line failed CI on it."""
    return sum(rec.get("bytes", 0) for rec in manifest_records(out))


def test_fleet_up_projects_the_output_refuses_what_cannot_fit_and_allow_partial_lets_it_through(
        tmp_path, dense_model, small_tmpfs):  # noqa: F811
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 120, vocab_size=500, mean_tokens=80, seed=9)
    tokens = sum(len(json.loads(l)["input_ids"]) for l in open(data))

    def config(run: str, dtype: str, output: str) -> str:
        return local_toml(tmp_path, f"""
[run]
name = "{run}"
model = {json.dumps(dense_model)}
data = {json.dumps(data)}
output = {json.dumps(output)}
dtype = "{dtype}"
max_tokens_per_batch = 1024
device = "cpu"
env = {{ OMP_NUM_THREADS = "1" }}

[supervise]
max_restarts = 0
""")

    # What the projection should say, from the rows' lengths (4 layers x 64 x 2 bytes, or x 1 byte +
    # a float32 scale per layer, + ids and mask, + each file's header); a disk between the two:
    # bf16 cannot fit and is refused, nothing launched; fp8 can (with room for tmpfs' pages).
    bf16 = tokens * (4 * 64 * 2 + 9) + 120 * 360
    fp8 = tokens * (4 * (64 + 4) + 9) + 120 * 480
    size_k = int((bf16 + 1.3 * fp8) / 2 / 1024)
    subprocess.run(["mount", "-o", f"remount,size={size_k}k", small_tmpfs], check=True)
    out = os.path.join(small_tmpfs, "bf16")
    r = fleet("up", "--headless", "-c", config("b", "bf16", out))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"output: {bf16 / 1e6:.2f} MB for the whole run in bf16: 120 rows, {tokens:,} tokens " \
        f"(input_ids lengths of all 120 rows) x 4 layers x 64 x 2 bytes" in r.stderr, r.stderr
    refusal = [l for l in r.stderr.splitlines() if l.startswith("error: preflight refused:")]
    assert len(refusal) == 1 and f"local: output {out} needs {bf16 / 1e6:.2f} MB more for shard(s) 0" in refusal[0]
    assert 'dtype = "fp8" needs about 2.' in refusal[0] and "fleet up --allow-partial" in refusal[0]
    assert not os.path.exists(tmp_path / "fleet" / "b" / "shards")
    # --allow-partial: it launches, fills the disk, and the shard fails saying so.
    r = fleet("up", "--headless", "--allow-partial", "-c", config("b", "bf16", out))
    assert r.returncode == 1 and "--allow-partial: it stops when the disk is full" in r.stderr, r.stderr
    events = [json.loads(l) for l in open(tmp_path / "fleet" / "b" / "shards" / "0" / "events.jsonl")]
    assert any(e["event"] == "failed" and e["reason"].startswith("disk full") for e in events), (r.stdout, r.stderr[-3000:], events[-5:])
    assert 0 < manifest_bytes(out) < size_k << 10 and verify(out)["problems"] == []
    subprocess.run(["rm", "-rf", out], check=True)
    # fp8 fits, and the projection is what the worker then wrote.
    out = os.path.join(small_tmpfs, "fp8")
    r = fleet("up", "--headless", "-c", config("f", "fp8", out))
    assert r.returncode == 0, r.stderr
    assert f"output: {fp8 / 1e6:.2f} MB for the whole run in fp8: 120 rows, {tokens:,} tokens " in r.stderr
    assert "x 4 layers x 64 x 1 byte + a float32 scale per token per layer" in r.stderr
    assert abs(fp8 - manifest_bytes(out)) < 0.01 * fp8
    report = verify(out)
    assert report["problems"] == [] and report["dtype"] == "fp8" and report["written"] == [[0, 120]]
    v = fleet("verify", "-c", config("f", "fp8", out))
    assert v.returncode == 0 and "(format speculators, fp8)" in v.stdout and "verify: OK" in v.stdout, v.stdout


def test_preflight_measures_the_output_disk_and_says_when_it_would_set_the_pace(tmp_path, dense_model):
    """Through the real preflight on a real disk: `fleet up` prints what the output disk took
    (fsync'd files, 8 at once) and, where the GPUs at the expected rate would write faster, says
    the disk sets the pace, with the ways out; at a rate the disk keeps up with, it says nothing."""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 40, vocab_size=500, mean_tokens=30, seed=3)

    def up(run: str, tokens_per_s: float):
        return fleet("up", "--headless", "-c", local_toml(tmp_path, f"""
[run]
name = "{run}"
model = {json.dumps(dense_model)}
data = {json.dumps(data)}
output = {json.dumps(str(tmp_path / run))}
device = "cpu"
env = {{ OMP_NUM_THREADS = "1" }}

[expected]
tokens_per_s_per_gpu = {tokens_per_s}
"""))
    fast = up("fast", 1e12)                       # 1e12 tokens/s x 4 layers x 64 x 2 bytes: no disk takes that
    assert fast.returncode == 0, fast.stderr
    measured = [l for l in fast.stderr.splitlines() if l.startswith("output disks measured: local ")]
    assert len(measured) == 1 and measured[0].endswith("/s (fsync'd files, 8 at once)"), fast.stderr
    warning = [l for l in fast.stderr.splitlines() if "the disk, not the GPU, sets the pace" in l]
    assert len(warning) == 1 and warning[0].startswith("warning: local: its 1 GPU(s) write ") and \
        "at the expected 1,000,000,000,000 tokens/s a GPU, its output disk(s) took " in warning[0], warning
    assert 'dtype = "fp8" halves the bytes; another disk in [run] output = [...] adds its rate' in warning[0]
    slow = up("slow", 10)                         # 10 tokens/s: a few kB/s
    assert slow.returncode == 0 and "output disks measured: local " in slow.stderr, slow.stderr
    assert "sets the pace" not in slow.stderr, slow.stderr
