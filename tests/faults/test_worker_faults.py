"""Faults at the worker: SIGKILL at seeded random moments, a full disk, out-of-memory splitting,
enormous rows. After each: nothing lost, nothing corrupt, nothing twice."""

from __future__ import annotations

import glob
import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from worker.verify import verify
from tests.conftest import REPO, read_events, run_worker


def recorded(out: str) -> list[int]:
    return [json.loads(l)["index"] for p in glob.glob(os.path.join(out, "manifest", "*.jsonl"))
            for l in open(p) if l.strip()]


def all_visible_files_load(out: str, seen: dict | None = None) -> None:
    """Every file a `hs_*.safetensors` glob sees is complete (loads, shapes agree). `seen`: path ->
    (inode, size, mtime) of the files found whole before; one unchanged since is not read again."""
    for path in glob.glob(os.path.join(out, "hs_*.safetensors")):
        key = stamp(path)
        if seen is not None and key is not None and seen.get(path) == key:
            continue
        t = load_file(path)
        assert t["hidden_states"].shape[0] == t["token_ids"].shape[0] == t["loss_mask"].shape[0]
        if seen is not None:
            seen[path] = key


def stamp(path: str):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def verify_problems(out: str, checked: dict) -> list[str]:
    """What a deep `verify(out)` finds: its report from the manifests (shallow) and every recorded
    sample's file opened and checked as it checks them (worker.verify.check_file: shapes as declared,
    finite values, stats, MD5) — a file checked whole after an earlier kill and unchanged since (its
    inode, size and mtime; files are only ever replaced whole) is not opened again. `checked`: index ->
    that stamp, kept across the trials."""
    from worker.verify import _read_manifests, _read_meta, check_file, layout_of
    problems = list(verify(out, deep=False)["problems"])
    meta = _read_meta(out)
    layout = layout_of(meta)
    for rec in _read_manifests(out, meta.get("num_samples")).written:
        key = stamp(layout.path(out, rec["index"]))
        if key is not None and checked.get(rec["index"]) == key:
            continue
        if problem := check_file(layout, out, rec, meta.get("hidden_size")):
            problems.append(problem)
        elif key is not None:
            checked[rec["index"]] = key
    return problems


def test_sigkill_at_10_seeded_moments_never_loses_or_corrupts(tmp_path, dense_model):
    from worker.demo import make_token_dataset
    rows = 5000                   # more than 10 trials get through (160-573 rows on CI's 2 cores; 15,000
                                  # cost 70 s to finish and verify): most kills land while it runs
    data = make_token_dataset(str(tmp_path / "d.jsonl"), rows, vocab_size=500, mean_tokens=50, seed=9)
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    args = [sys.executable, "-m", "worker.extract", "--model", dense_model, "--data", data, "--out", out,
            "--state", state, "--max-tokens-per-batch", "256"]
    rng = random.Random(20261130)
    kills = 0
    loaded_whole, checked = {}, {}       # what is read again after each kill: only what changed (a full
                                         # deep verify after each of 10 kills read 15,000 files 10 times)
    for trial in range(10):                                # (20 cost CI 4 minutes; 10 land in every phase)
        moment = rng.uniform(0.5, 7.0)                    # loading, first batches, or mid-run
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(moment)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
        assert proc.returncode in (0, -signal.SIGKILL), f"trial {trial}: the worker failed (exit {proc.returncode})"
        all_visible_files_load(out, loaded_whole)
        if os.path.isdir(out):
            problems = verify_problems(out, checked)
            assert problems == [], (trial, problems[:3])
        indices = recorded(out)
        assert len(indices) == len(set(indices)), f"trial {trial}: a sample recorded twice"
    assert kills >= 7, "most of the moments should land while the worker runs"
    r = run_worker(*args[3:-1], "4096")     # the rest in batches 16x as large: resumed under another size
    assert r.returncode == 0, r.stderr
    assert sorted(recorded(out)) == list(range(rows))
    rep = verify(out)
    assert rep["problems"] == [] and rep["written"] == [[0, rows]]


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("the disk-full test mounts a tmpfs and needs root (CI runs as root)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    yield str(mnt)
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_fails_cleanly_and_a_restart_after_freeing_space_completes(tmp_path, dense_model, small_tmpfs):
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 300, vocab_size=500, mean_tokens=60, seed=4)
    out, state = os.path.join(small_tmpfs, "out"), str(tmp_path / "state")
    # Small batches: several complete (and are recorded) before the disk fills mid-batch.
    small = ("--max-tokens-per-batch", "1024")
    r = run_worker("--model", dense_model, "--data", data, "--out", out, "--state", state, *small)
    assert r.returncode == 1
    assert "disk full" in r.stderr and "Traceback" not in r.stderr
    failed = [e for e in read_events(state) if e["event"] == "failed"]
    assert failed and failed[-1]["reason"].startswith("disk full")
    assert not [f for f in os.listdir(out) if f.startswith(".tmp-")], "no temp file left behind"
    all_visible_files_load(out)
    before = recorded(out)
    assert 0 < len(before) < 300
    assert verify(out)["problems"] == []                     # what was finished is intact
    subprocess.run(["mount", "-o", "remount,size=200m", small_tmpfs], check=True)
    r = run_worker("--model", dense_model, "--data", data, "--out", out, "--state", state, *small)
    assert r.returncode == 0, r.stderr
    assert sorted(recorded(out)) == list(range(300))
    assert verify(out)["problems"] == []


class OomAbove(torch.nn.Module):
    """Fault injection around the real model: raises CUDA OOM for batches over `limit` tokens."""

    def __init__(self, model: torch.nn.Module, limit: int):
        super().__init__()
        self.inner = model
        self.limit = limit
        self.calls: list[int] = []

    def forward(self, input_ids, **kw):
        self.calls.append(input_ids.numel())
        if input_ids.numel() > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return self.inner(input_ids=input_ids, **kw)


def test_out_of_memory_splits_batches_and_skips_only_what_cannot_fit(tmp_path, dense_model):
    from worker.data import Sample
    from worker.events import EventLog
    from worker.extract import Options, run_extraction
    from worker.layers import resolve_layers
    from worker.model import load_model
    from worker.writer import Stats

    model = load_model(dense_model, "cpu", torch.float32)
    wrapped = OomAbove(model, limit=64)
    wrapped.layers = model.layers                              # hooks go on the real layers
    wrapped.norm = model.norm
    rng = np.random.default_rng(0)
    lengths = [10, 12, 30, 9, 80, 20, 11]                      # 80 tokens never fits
    samples = [Sample(i, rng.integers(0, 400, n), np.ones(n, dtype=np.uint8)) for i, n in enumerate(lengths)]
    out, state = str(tmp_path / "out"), str(tmp_path / "st")
    log = EventLog(state, 0)
    stats = run_extraction(wrapped, [samples], resolve_layers("speculators", 8), out, 0, torch.device("cpu"),
                           Options(max_tokens_per_batch=4096, pad_multiple=1), log, Stats(), total=len(samples))
    assert stats.done == 6 and stats.skipped == 1
    skipped = [e for e in read_events(state) if e["event"] == "sample_skipped"]
    assert skipped == [dict(skipped[0], index=4, reason="out of GPU memory at 80 tokens (alone, after the rest)")]
    assert max(wrapped.calls) > 64 and min(wrapped.calls) <= 64      # it did split
    for i in (0, 1, 2, 3, 5, 6):
        t = load_file(os.path.join(out, f"hs_{i}.safetensors"))
        assert t["hidden_states"].shape == (lengths[i], 4, 64)


def test_enormous_row_is_skipped_with_its_length(tmp_path, dense_model):
    data = tmp_path / "big.jsonl"
    rows = [{"input_ids": [1, 2, 3]}, {"input_ids": list(range(400)) * 500}, {"input_ids": [4, 5]}]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out, state = str(tmp_path / "out"), str(tmp_path / "st")
    r = run_worker("--max-skip-fraction", "1", "--model", dense_model, "--data", str(data), "--out", out, "--state", state,
                   "--max-length", "4096")
    assert r.returncode == 0, r.stderr
    skipped = {e["index"]: e["reason"] for e in read_events(state) if e["event"] == "sample_skipped"}
    assert skipped == {1: "too long: 200000 tokens > --max-length 4096"}
    assert sorted(recorded(out)) == [0, 1, 2]


def test_output_files_are_not_world_writable(tmp_path, dense_model, token_data):
    out, state = str(tmp_path / "out"), str(tmp_path / "st")
    old = os.umask(0)                                     # even under a permissive umask
    try:
        assert run_worker("--model", dense_model, "--data", token_data, "--out", out, "--state", state).returncode == 0
    finally:
        os.umask(old)
    for root in (out, state):
        for dirpath, dirnames, filenames in os.walk(root):
            for name in filenames + dirnames:
                mode = os.stat(os.path.join(dirpath, name)).st_mode
                assert not mode & 0o002, f"{name} is world-writable ({oct(mode)})"
