"""Shipping to a destination (worker/ship.py) through the real worker on the tiny model, into a
real S3-compatible store (`rclone serve s3` on 127.0.0.1) that the tests kill and restart.

Invariants: a file leaves the local disk only once the store holds it whole (at every moment,
every written index is local or at the store, never neither); with keep_local the shard's local
files never exceed the bound (as sampled from the disk by the test, and as the worker says); the
store ends holding every written file with the size the manifest records; an outage pauses
shipping, never fails the shard."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import REPO, read_events, wait_for
from tests.s3_store import S3Store
from worker.ship import ShipError, destination

ROWS = 240
SFTP_ROWS = 40                    # sftp:// ships over ssh sessions: the same checks on fewer rows (80 cost CI a
                                  # minute: a session a batch)
KEEP = 600_000                    # bytes; a batch of 512 tokens here is ~280 kB, so the bound bites


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> str:
    from worker.demo import make_chat_dataset
    return make_chat_dataset(str(tmp_path_factory.mktemp("ship") / "chat.jsonl"), ROWS, mean_words=30)


@pytest.fixture
def store(tmp_path):
    s = S3Store(str(tmp_path / "store")).start()
    yield s
    s.kill()


def rclones_of(out: str) -> list[str]:
    """The rclone processes working on `out` now (their command lines)."""
    found = subprocess.run(["pgrep", "-af", "rclone"], capture_output=True, text=True).stdout.splitlines()
    return [line for line in found if out in line]


def at_store_md5(store, prefix: str) -> dict[str, str]:
    """name -> MD5 of every sample file at the store, read from the store's own disk."""
    from worker.files import file_md5
    return {name: file_md5(os.path.join(store.bucket_dir(prefix), name))
            for name in store.files(prefix) if name.startswith("hs_")}


def nothing_lost(out: str, store, rounds: int) -> None:
    """Every written file is here or at the store whole, and the local ones within KEEP, sampled
    `rounds` times half a second apart (the invariant while the store cannot be reached)."""
    for _ in range(rounds):
        recorded, here, there = written(out), local_samples(out), store.files("run")
        for i in recorded:
            name = f"hs_{i}.safetensors"
            assert name in here or there.get(name) == recorded[i], f"sample {i} is neither here nor there"
        assert sum(here.values()) <= KEEP
        time.sleep(0.5)


def extract(model: str, data: str, out: str, state: str, dest: str, env: dict, *more: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "worker.extract", "--model", model, "--data", data, "--out", out,
         "--state", state, "--device", "cpu", "--max-tokens-per-batch", "512", "--destination", dest,
         "--keep-local", str(KEEP), *more],
        cwd=REPO, env={**os.environ, **env, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def local_samples(out: str) -> dict[str, int]:
    """The shard's sample files on the local disk now (name -> bytes), read from the disk itself."""
    sizes = {}
    for name in os.listdir(out) if os.path.isdir(out) else []:
        if name.startswith("hs_"):
            try:
                sizes[name] = os.path.getsize(os.path.join(out, name))
            except FileNotFoundError:        # shipped between the listing and the stat
                pass
    return sizes


def written(out: str) -> dict[int, int]:
    """index -> bytes, of every sample the manifest records as written."""
    path = os.path.join(out, "manifest", "0.jsonl")
    recs = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return {r["index"]: r["bytes"] for r in recs if "bytes" in r}


class DiskSampler:
    """The local sample files' total, sampled from the disk every few ms while a shard runs."""

    def __init__(self, out: str):
        self.out, self.peak, self.stop = out, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, sum(local_samples(self.out).values()))
            time.sleep(0.005)

    def close(self) -> int:
        self.stop.set()
        self.thread.join()
        return self.peak


def test_destinations_map_to_rclone_remotes_and_bad_ones_are_named():
    s3 = destination("s3://bucket/runs/a", {"AWS_ENDPOINT_URL": "http://10.0.0.5:9000", "AWS_REGION": "eu-1"})
    assert s3.remote == ":s3:bucket/runs/a"
    assert s3.env == {"RCLONE_S3_PROVIDER": "Other", "RCLONE_S3_ENV_AUTH": "true", "RCLONE_S3_NO_CHECK_BUCKET": "true",
                      "RCLONE_S3_ENDPOINT": "http://10.0.0.5:9000", "RCLONE_S3_REGION": "eu-1"}
    assert destination("s3://bucket", {}).env["RCLONE_S3_PROVIDER"] == "AWS"
    sftp = destination("sftp://me@store:2222/data/run", {})
    assert (sftp.remote, sftp.env) == (":sftp:/data/run",
                                       {"RCLONE_SFTP_SSH": "ssh -o BatchMode=yes -p 2222 me@store"})
    assert destination("/mnt/nfs/run", {}).remote == "/mnt/nfs/run"
    for url, says in (("ftp://x/y", "s3://, sftp:// or a path"), ("s3:///p", "no bucket (s3://bucket/prefix)"),
                      ("sftp://host", "sftp://[user@]host[:port]/path")):
        with pytest.raises(ShipError) as e:
            destination(url, {})
        assert str(e.value) == f"destination {url}: {says}"


def test_a_shard_ships_to_s3_within_keep_local_and_the_store_holds_every_file_whole(
        dense_model, rows, store, tmp_path):
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    sampler = DiskSampler(out)
    proc = extract(dense_model, rows, out, state, "s3://bucket/run", store.env(), "--random-weights")
    _, err = proc.communicate(timeout=600)
    peak = sampler.close()
    assert proc.returncode == 0, err[-2000:]
    events = read_events(state)
    shipping = [e for e in events if e["event"] == "shipping"]
    assert any(e.get("waiting", "").startswith("waiting for shipping") for e in shipping)   # the bound bit
    assert max(e["local_bytes"] for e in shipping) <= KEEP
    assert 0 < peak <= KEEP                                   # the disk itself, sampled by the test
    assert local_samples(out) == {}                           # everything shipped left the disk
    recorded = written(out)
    assert len(recorded) == ROWS
    at_store = store.files("run")
    assert {k: v for k, v in at_store.items() if k.startswith("hs_")} == \
        {f"hs_{i}.safetensors": n for i, n in recorded.items()}
    assert "manifest/0.jsonl" in at_store and "meta.json" in at_store
    last = shipping[-1]
    assert last["finished"] and last["shipped_files"] == ROWS and last["pending_files"] == 0
    assert events[-1]["event"] == "done"
    # What bounds it: the writer counted its waits for room; the shipping events said when each
    # began and ended (an independent clock of the same waits); the supervisor's own record and
    # fleet/bound.py read the counts as bound by the upload.
    said, began = 0.0, None
    for e in shipping:
        if e.get("waiting", "").startswith("waiting for shipping"):
            began = e["t"] if began is None else began
        elif began is not None:
            said, began = said + e["t"] - began, None
    counted = events[-1]["ship_wait_s"]
    assert 0.5 * said - 1 <= counted <= 2 * said + 1, (counted, said)
    from fleet.bound import verdict
    from fleet.record import ShardRecord
    from worker import protocol as wire
    record = ShardRecord()
    record.apply(wire.Launch(t=events[0]["t"], launch=1))
    for ev in wire.read_events(os.path.join(state, "events.jsonl")):
        record.apply(ev)
    bound = verdict([record.whole_wait])
    assert bound is not None and bound.by == "upload", (bound, record.whole_wait)
    # the store's copy reads as the local files would have: tokens as recorded, every file opens
    from worker.verify import check_destination
    env = store.env()
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        report = check_destination("s3://bucket/run")
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert report.problems == [] and report.written == [[0, ROWS]] and report.num_samples == ROWS
    from worker.verify import check_folder
    assert check_folder(store.bucket_dir("run")).problems == []   # every file opened, shapes, finite


def test_the_store_killed_and_restarted_pauses_shipping_loses_nothing_and_fails_nothing(
        dense_model, rows, store, tmp_path):
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    proc = extract(dense_model, rows, out, state, "s3://bucket/run", store.env(), "--random-weights")
    try:
        def shipping():
            return [e for e in read_events(state) if e["event"] == "shipping"]
        wait_for(lambda: any(e["shipped_files"] > 0 for e in shipping()), 120, what="first files shipped")
        store.kill()
        wait_for(lambda: any(e.get("error") for e in shipping()), 120, what="the outage told")
        wait_for(lambda: any(e.get("waiting") for e in shipping()[-3:]), 120, what="the writer waiting")
        nothing_lost(out, store, rounds=5)   # during the outage
        assert proc.poll() is None           # waiting, not failed
        store.start()
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-2000:]
    events = read_events(state)
    assert not [e for e in events if e["event"] == "failed"]
    recorded = written(out)
    assert len(recorded) == ROWS and local_samples(out) == {}
    at_store = {k: v for k, v in store.files("run").items() if k.startswith("hs_")}
    assert at_store == {f"hs_{i}.safetensors": n for i, n in recorded.items()}
    assert events[-2]["event"] == "shipping" and events[-2]["shipped_files"] == ROWS   # each counted once


def test_a_restart_ships_what_an_earlier_launch_left_on_the_disk(dense_model, rows, store, tmp_path):
    """A launch that dies with files unshipped (here: the store refuses it) leaves them on the disk;
    the next launch counts them as pending and ships them before it is done."""
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    store.kill()                              # nothing lands: every file stays local
    proc = extract(dense_model, rows, out, state, "s3://bucket/run", store.env(), "--random-weights")
    wait_for(lambda: len(local_samples(out)) > 0 and any(e["event"] == "shipping" and e.get("waiting")
                                                         for e in read_events(state)), 120,
             what="files written and waiting")
    proc.terminate()
    proc.communicate(timeout=120)
    left = set(local_samples(out))
    assert left and set(f"hs_{i}.safetensors" for i in written(out)) == left
    store.start()
    proc = extract(dense_model, rows, out, state, "s3://bucket/run", store.env(), "--random-weights")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    assert local_samples(out) == {}
    assert left <= set(store.files("run"))
    assert len([k for k in store.files("run") if k.startswith("hs_")]) == ROWS


@pytest.mark.ssh
def test_sftp_through_the_hosts_own_ssh(dense_model, rows, sshd, tmp_path):
    """sftp://: rclone over the host's ssh (here told its key and known_hosts through
    RCLONE_SFTP_SSH, as ~/.ssh/config would): every file lands, none stays."""
    out, state, dest = str(tmp_path / "out"), str(tmp_path / "state"), str(tmp_path / "dest")
    few = tmp_path / "few.jsonl"                  # a sixth of the rows: each batch's transfer is an ssh session
    few.write_text("".join(open(rows).readlines()[:SFTP_ROWS]))
    rows = str(few)
    ssh = (f"ssh -i {sshd.client_key} -o UserKnownHostsFile={sshd.known_hosts} -o BatchMode=yes "
           f"-p {sshd.port} root@127.0.0.1")
    proc = extract(dense_model, rows, out, state, f"sftp://root@127.0.0.1:{sshd.port}{dest}",
                   {"RCLONE_SFTP_SSH": ssh}, "--random-weights")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    recorded = written(out)
    assert len(recorded) == SFTP_ROWS and local_samples(out) == {}
    assert {n: os.path.getsize(os.path.join(dest, n)) for n in os.listdir(dest) if n.startswith("hs_")} == \
        {f"hs_{i}.safetensors": n for i, n in recorded.items()}


def test_a_byte_flipped_at_the_store_is_named_by_verify_and_repair_has_the_sample_redone(
        dense_model, rows, store, tmp_path):
    """Each shipped file's manifest record carries the MD5 its writer read back from the disk; the
    store's copy is checked against it, so bytes changed at the store (same size) are named; the
    host's --repair drops the entry (its file left the host) and removes the bad copy; the next
    launch redoes that one sample and ships it."""
    from worker.verify import check_destination
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    proc = extract(dense_model, rows, out, state, "s3://bucket/run", store.env(), "--random-weights")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    records = {i: r for i, r in ((r["index"], r) for r in map(json.loads, open(os.path.join(out, "manifest", "0.jsonl"))))}
    assert at_store_md5(store, "run") == {f"hs_{i}.safetensors": r["md5"] for i, r in records.items()}
    victim = sorted(records)[len(records) // 2]
    path = os.path.join(store.bucket_dir("run"), f"hs_{victim}.safetensors")
    data = bytearray(open(path, "rb").read())
    data[-7] ^= 0xFF                                       # a value's byte: the file still parses
    open(path, "wb").write(bytes(data))
    with store_env(store):
        report = check_destination("s3://bucket/run")
        assert [p.split(":")[0] for p in report.problems] == [f"sample {victim}"]
        assert "MD5" in report.problems[0] and "changed after writing" in report.problems[0]
        mended = check_destination("s3://bucket/run", out=out, repair=True)
    assert mended.repaired.dropped == [victim] and mended.repaired.reshipped == []
    assert f"hs_{victim}.safetensors" not in store.files("run")
    assert victim not in {json.loads(line)["index"] for line in open(os.path.join(out, "manifest", "0.jsonl"))}
    proc = extract(dense_model, rows, out, state, "s3://bucket/run", store.env(), "--random-weights")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    with store_env(store):
        report = check_destination("s3://bucket/run")
    assert report.problems == [] and report.written == [[0, ROWS]]
    redone = [e for e in read_events(state) if e["event"] == "leased"][-1]
    assert redone["rows"] == 1                                # exactly that sample redone


def test_repair_at_the_destination_ships_again_what_is_still_whole_on_the_host(dense_model, rows, store, tmp_path):
    """Files a killed launch left on the disk (the store was down) are missing at the destination
    but whole here: --repair keeps their entries (nothing to redo) and says they ship again; the
    killed worker's rclone did not outlive it; the next launch ships them."""
    from worker.verify import check_destination
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    store.kill()
    proc = extract(dense_model, rows, out, state, "s3://bucket/run", store.env(), "--random-weights")
    wait_for(lambda: rclones_of(out) and any(e["event"] == "shipping" and e.get("waiting") for e in read_events(state)),
             120, what="files written and an rclone trying")
    proc.kill()
    proc.communicate(timeout=60)
    wait_for(lambda: not rclones_of(out), 3, what="the dead worker's rclone ended with it")
    left = sorted(written(out))
    store.start()
    with store_env(store):
        mended = check_destination("s3://bucket/run", out=out, repair=True)
        assert mended.repaired.reshipped == left and mended.repaired.dropped == []
        assert [p for p in mended.problems if "missing at the destination" in p] and sorted(written(out)) == left
    proc = extract(dense_model, rows, out, state, "s3://bucket/run", store.env(), "--random-weights")
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    with store_env(store):
        report = check_destination("s3://bucket/run")
    assert report.problems == [] and report.written == [[0, ROWS]] and local_samples(out) == {}


def test_a_dead_mates_files_are_shipped_by_the_shard_that_finishes_its_rows(dense_model, rows, store, tmp_path):
    """Shard 1 of a pool of two dies with files unshipped (the store down); shard 0 takes its rows
    over, and at its end ships what shard 1 left, told in shard 1's own record: nothing stays on
    the host, the store holds every row once."""
    out = str(tmp_path / "out")
    states = {k: str(tmp_path / "run" / "shards" / str(k)) for k in (0, 1)}
    pool = ("--num-shards", "2", "--pool", "0,1")
    store.kill()
    dead = extract(dense_model, rows, out, states[1], "s3://bucket/run", store.env(), "--random-weights",
                   "--shard-index", "1", *pool)
    wait_for(lambda: any(e["event"] == "shipping" and e.get("waiting") for e in read_events(states[1])), 120,
             what="shard 1 waiting for shipping")
    dead.kill()
    dead.communicate(timeout=60)
    left = set(local_samples(out))
    assert left
    store.start()
    proc = extract(dense_model, rows, out, states[0], "s3://bucket/run", store.env(), "--random-weights",
                   "--shard-index", "0", *pool)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    assert local_samples(out) == {}
    at_store = {k for k in store.files("run") if k.startswith("hs_")}
    assert left <= at_store and len(at_store) == ROWS
    told = [e for e in read_events(states[1]) if e["event"] == "shipping"][-1]
    assert told["finished"] and told["pending_files"] == 0 and told["shipped_files"] == len(left)


class store_env:
    """The store's AWS variables in this process's environment (check_destination reads them)."""

    def __init__(self, store):
        self.env = store.env()

    def __enter__(self):
        self.old = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
