"""Several local disks for one host's output ([run] output = [folder, folder, ...]; the worker's
--spill): sample i's bytes go to the folders in turn, the output folder holds a link to each, so
every reader of the output folder (verify, speculators' own dataset, a destination's shipper) sees
one folder while the writes spread over the disks.

Invariants: every written sample's bytes are on exactly one folder, the one whose turn it is
(counted from the disks themselves); the output folder reads as if it held them all; a repair
removes a broken sample's bytes wherever they are; shipped, nothing stays on any disk."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest

from tests.conftest import run_worker
from tests.worker.test_ship import KEEP, ROWS, DiskSampler, extract, store, written  # noqa: F401  (store: fixture)
from worker.files import disk_of
from worker.verify import check_folder


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> str:
    from worker.demo import make_chat_dataset
    return make_chat_dataset(str(tmp_path_factory.mktemp("disks") / "chat.jsonl"), ROWS, mean_words=30)


def real_files(folder: str) -> set[int]:
    """Indices whose bytes are in `folder` itself (regular files, not links)."""
    return {int(n[3:].split(".")[0]) for n in os.listdir(folder)
            if n.startswith("hs_") and os.path.isfile(os.path.join(folder, n))
            and not os.path.islink(os.path.join(folder, n))} if os.path.isdir(folder) else set()


def test_samples_go_to_the_disks_in_turn_and_the_output_folder_reads_as_one(dense_model, rows, tmp_path):
    out, spill = str(tmp_path / "nvme0" / "run"), str(tmp_path / "nvme1" / "run")
    r = run_worker("--model", dense_model, "--data", rows, "--out", out, "--spill", spill, "--device", "cpu",
                   "--random-weights", "--max-tokens-per-batch", "512")
    assert r.returncode == 0, r.stderr[-2000:]
    recorded = written(out)
    assert len(recorded) == ROWS
    here, there = real_files(out), real_files(spill)
    assert here | there == set(recorded) and not here & there            # each sample's bytes once
    assert all(disk_of(i, (out, spill)) == (out if i in here else spill) for i in recorded)
    assert len(there) == ROWS // 2                                      # an equal share each
    assert all(os.path.islink(os.path.join(out, f"hs_{i}.safetensors")) for i in there)
    assert check_folder(out).problems == []                             # every file opened through its link
    from speculators.train.data import ArrowDataset
    ds = ArrowDataset(max_len=4096, datapath=os.path.join(out, "prepared"), on_missing="raise")
    assert len(ds) == ROWS and all(ds[k]["loss_mask"].sum() > 0 for k in range(len(ds)))
    # a sample whose bytes broke on the other disk: verify names it, --repair removes it there too
    victim = min(there)
    with open(os.path.join(spill, f"hs_{victim}.safetensors"), "r+b") as f:
        f.truncate(100)
    assert [p.split(":")[0] for p in check_folder(out).problems] == [f"sample {victim}"]
    repaired = check_folder(out, repair=True).repaired
    assert repaired.dropped == [victim] and repaired.removed_files == 1
    assert not os.path.lexists(os.path.join(out, f"hs_{victim}.safetensors"))
    assert not os.path.exists(os.path.join(spill, f"hs_{victim}.safetensors"))
    r = run_worker("--model", dense_model, "--data", rows, "--out", out, "--spill", spill, "--device", "cpu",
                   "--random-weights", "--max-tokens-per-batch", "512")
    assert r.returncode == 0, r.stderr[-2000:]
    assert victim in real_files(spill) and check_folder(out).problems == []


class DisksSampler(DiskSampler):
    """The sample files' bytes on several disks together (links not counted), sampled every few ms."""

    def __init__(self, folders: list[str]):
        self.folders, self.spilled = folders, 0
        super().__init__(folders[0])

    def _run(self):
        while not self.stop.is_set():
            sizes = [sum(st.st_size for st in map(self._lstat, self._names(f)) if st) for f in self.folders]
            self.peak, self.spilled = max(self.peak, sum(sizes)), max(self.spilled, sizes[-1])
            time.sleep(0.005)

    @staticmethod
    def _names(folder):
        return [os.path.join(folder, n) for n in (os.listdir(folder) if os.path.isdir(folder) else [])
                if n.startswith("hs_")]

    @staticmethod
    def _lstat(path):
        try:
            st = os.lstat(path)
            return None if stat.S_ISLNK(st.st_mode) else st
        except FileNotFoundError:
            return None


def test_shipped_from_several_disks_within_keep_local_nothing_stays_on_any(dense_model, rows, store, tmp_path):
    out, spill = str(tmp_path / "nvme0" / "run"), str(tmp_path / "nvme1" / "run")
    sampler = DisksSampler([out, spill])
    proc = extract(dense_model, rows, out, str(tmp_path / "state"), "s3://bucket/run", store.env(),
                   "--random-weights", "--spill", spill)
    _, err = proc.communicate(timeout=600)
    peak = sampler.close()
    assert proc.returncode == 0, err[-2000:]
    assert sampler.spilled > 0 and 0 < peak <= KEEP       # the bound holds over both disks together
    assert not [n for f in (out, spill) for n in os.listdir(f) if n.startswith("hs_")]   # no file, no link
    recorded = {i: r for i, r in ((r["index"], r) for r in map(json.loads, open(os.path.join(out, "manifest", "0.jsonl"))))}
    at = {k: v for k, v in store.files("run").items() if k.startswith("hs_")}
    assert at == {f"hs_{i}.safetensors": r["bytes"] for i, r in recorded.items()}
