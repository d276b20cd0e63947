"""`[run] destination` end to end: two hosts behind real sshds ship to one real S3-compatible
store (`rclone serve s3` on 127.0.0.1) within keep_local; the run ends DONE with one dataset at the
store, `fleet verify` checks it there, and speculators' own reader takes every sample of it,
downloaded as a user would. A destination that cannot be used is refused at preflight, one line
naming it, before any shard starts."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.faults.test_hostile_inputs import local_toml
from tests.fleet.conftest import fleet, hosts_toml, two_hosts
from tests.s3_store import S3Store

ROWS = 80          # 40 a host (or a shard), about twice KEEP of output each: the bound bites (120 cost CI
KEEP = 600_000     # half a minute more over this file's runs, ships and downloads, for nothing more)


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> str:
    from worker.demo import make_chat_dataset
    return make_chat_dataset(str(tmp_path_factory.mktemp("dest") / "chat.jsonl"), ROWS, mean_words=30)


def with_env(config: str, env: dict[str, str]) -> str:
    """The config's [run] env with `env` added (the hosts' credentials: a file's path, not keys)."""
    text = open(config).read()
    inline = ", ".join(f"{k} = {json.dumps(v)}" for k, v in {"OMP_NUM_THREADS": "1", **env}.items())
    open(config, "w").write(text.replace('env = { OMP_NUM_THREADS = "1" }', f"env = {{ {inline} }}"))
    return config


@pytest.mark.ssh
def test_two_hosts_ship_to_one_store_within_keep_local_and_speculators_reads_it_there(tmp_path, dense_model, rows):
    store = S3Store(str(tmp_path / "store")).start()
    try:
        with two_hosts(tmp_path) as (servers, _):
            config = hosts_toml(tmp_path, servers, model=dense_model, data=rows, gpus={"a": [0], "b": [0]},
                                output=str(tmp_path / "out-{host}"),
                                extra_run=f'destination = "s3://bucket/run"\nkeep_local = "{KEEP}"',
                                job="[expected]\ntokens_per_s_per_gpu = 1e9")   # beyond any uplink
            with_env(config, store.env(credentials_file=str(tmp_path / "aws-credentials")))
            up = fleet("up", "--headless", "-c", config, timeout=900)
            assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
            assert "output: ships to s3://bucket/run as it is written; each host keeps at most 600.00 kB" in up.stderr
            assert "; upload measured: a " in up.stderr and "/s, b " in up.stderr      # each host's, measured
            for name in ("a", "b"):
                assert re.search(rf"warning: {name}: its 1 GPU\(s\) write .* at the expected 1,000,000,000 tokens/s "
                                 rf"a GPU, its upload to s3://bucket/run measured .*/s: the uplink, not the GPU, "
                                 rf"sets the pace", up.stderr), up.stderr
            assert "shards DONE" in up.stdout and "at s3://bucket/run" in up.stdout
            snap = json.loads(fleet("status", "--json", "-c", config).stdout)
            if snap["totals"]["bound"] is not None:                     # (5 s of batches or more)
                assert snap["totals"]["bound"]["by"] in up.stdout.replace("GPU", "gpu")   # the finished line
                assert re.search(r"bound by (GPU|disk|upload): GPUs waited \d+%", up.stdout), up.stdout
            sh = snap["totals"]["shipping"]
            assert sh["finished"] and sh["shipped_files"] == ROWS and sh["pending_files"] == 0
            assert sorted(h["shipping"]["shipped_files"] for h in snap["hosts"]) == [ROWS // 2, ROWS // 2]
            from fleet.schema import Totals
            from fleet.tui.panes.topbar import fact_parts
            shown = [str(text) for _, text in fact_parts(Totals.model_validate(snap["totals"]))]
            assert f"shipped {sh['shipped_bytes'] / 1e6:.1f} MB" in shown         # the live view's top bar
            for name in ("a", "b"):                   # the worker's own samples of its local disk
                events = [json.loads(line) for line in
                          open(tmp_path / f"root-{name}" / "t" / "shards" / str("ab".index(name)) / "events.jsonl")]
                local = [e["local_bytes"] for e in events if e["event"] == "shipping"]
                assert local and max(local) <= KEEP
                # What bound the host, as status says it, against the worker's own last counts: its
                # GPU is the bound exactly when it waited for the writer under 5% of its batch time
                # (here the writer waits for shipping, and its host buffers may or may not absorb it).
                done = [e for e in events if e["event"] == "done"][-1]
                batches = done["t"] - done["batches_from"]
                bound = snap["hosts"]["ab".index(name)]["bound"]
                assert (bound is None) == (batches < 5), (bound, done)   # (under 5 s of batches: unsaid)
                if bound is not None:
                    assert (bound["by"] == "gpu") == (done["writer_wait_s"] / batches < 0.05), (bound, done)
                assert done["ship_wait_s"] > 0                          # the writer did wait for room
                out = tmp_path / f"out-{name}"
                assert not [n for n in os.listdir(out) if n.startswith("hs_")]     # all shipped
            v = fleet("verify", "-c", config, timeout=300)
            assert v.returncode == 0, v.stdout + v.stderr
            assert f"{ROWS} written, 0 skipped" in v.stdout and "verify: OK" in v.stdout
            assert "train (s3://bucket/run): speculators train" in v.stdout
            train = next(line for line in v.stdout.splitlines() if line.startswith("train (")).split(": ", 1)[1]
            # A byte flipped at the store: named by verify, redone through --repair and up.
            victim = 7
            path = os.path.join(store.bucket_dir("run"), f"hs_{victim}.safetensors")
            data = bytearray(open(path, "rb").read())
            data[-5] ^= 0xFF
            open(path, "wb").write(bytes(data))
            v = fleet("verify", "-c", config, timeout=300)
            assert v.returncode == 1 and f"problem: s3://bucket/run: sample {victim}: s3://bucket/run/hs_{victim}" \
                f".safetensors has MD5" in v.stdout, v.stdout + v.stderr
            r = fleet("verify", "--repair", "-c", config, timeout=300)
            assert f"repaired: dropped 1 broken or missing sample(s) [{victim}]" in r.stdout, r.stdout + r.stderr
            assert "shard 0: 1 sample(s) to redo" in r.stdout
            up = fleet("up", "--headless", "-c", config, timeout=900)
            assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
            v = fleet("verify", "-c", config, timeout=300)
            assert v.returncode == 0 and "verify: OK" in v.stdout, v.stdout + v.stderr
            assert "note: s3://bucket/run: the trainer reads a local folder DIR: `fleet download DIR` copies it there" in v.stdout
            # One dataset at the store: every host's files, both manifests, one meta.json; `fleet
            # download` copies it here as a user would (the store's own S3 API, fleet.toml's keys)
            # and indexes it for speculators, whose own ArrowDataset takes every sample.
            at = store.files("run")
            assert sorted(k for k in at if k.startswith("manifest/")) == ["manifest/0.jsonl", "manifest/1.jsonl"]
            assert len([k for k in at if k.startswith("hs_")]) == ROWS and "meta.json" in at
            local = str(tmp_path / "download")
            d = fleet("download", local, "-c", config, timeout=300)
            assert d.returncode == 0, d.stdout + d.stderr
            assert f"prepared/: {ROWS} rows indexed for speculators" in d.stderr, d.stderr
            assert sorted(n for n in os.listdir(local) if n.startswith("hs_")) == sorted(k for k in at if k.startswith("hs_"))
            assert d.stdout.startswith(f"train: {train.replace('DIR', local)}"), (d.stdout, train)
            stamp = lambda n: (os.stat(os.path.join(local, n)).st_ino, os.stat(os.path.join(local, n)).st_ctime_ns)
            stamps = {n: stamp(n) for n in os.listdir(local) if n.startswith("hs_")}
            again = fleet("download", local, "-c", config, timeout=300)      # resumes: nothing is copied twice
            assert again.returncode == 0 and again.stdout == d.stdout, again.stdout + again.stderr
            assert {n: stamp(n) for n in stamps} == stamps                     # (a copy is a new inode)
    finally:
        store.kill()
    pytest.importorskip("speculators.train.data")
    from speculators.train.data import ArrowDataset
    ds = ArrowDataset(max_len=4096, datapath=os.path.join(local, "prepared"), on_missing="raise")
    assert len(ds) == ROWS
    assert all(ds[k]["loss_mask"].sum() > 0 for k in range(len(ds)))
    # ... and speculators' own training, by the command verify printed, on the local copy
    flags = shlex.split(train.replace("DIR", local))
    assert flags[:2] == ["speculators", "train"]
    r = subprocess.run([sys.executable, "-m", "tests.trainers.run_speculators", *flags[2:],
                        "--save-path", str(tmp_path / "ckpt"), "--epochs", "1", "--total-seq-len", "1024",
                        "--num-workers", "0", "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
                        "--no-resume-from-checkpoint"],
                       cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["unavailable"] == [] and sorted(map(int, got["loaded"])) == list(range(ROWS))  # train + val: all
    assert len(got["losses"]) >= 1 and all(math.isfinite(x) for x in got["losses"])


@pytest.mark.parametrize("case,says", [
    ("bucket", "NoSuchBucket: The specified bucket does not exist"),
    ("keys", "Forbidden: Forbidden (check the keys: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or ~/.aws)"),
    ("down", "dial tcp 127.0.0.1:{port}: connect: connection refused"),
])
def test_a_destination_that_cannot_be_used_is_refused_at_preflight_naming_it(tmp_path, dense_model, rows, case, says):
    store = S3Store(str(tmp_path / "store")).start()
    try:
        env = store.env()
        url = "s3://nobucket/run" if case == "bucket" else "s3://bucket/run"
        if case == "keys":
            env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
        if case == "down":
            store.kill()
        config = local_toml(tmp_path, f"""[run]
name = "r"
model = {json.dumps(dense_model)}
data = {json.dumps(rows)}
output = "out"
device = "cpu"
destination = "{url}"
""")
        up = fleet("up", "--headless", "-c", config, timeout=300, env={**os.environ, **env})
        down = fleet("download", str(tmp_path / "dl"), "-c", config, timeout=300, env={**os.environ, **env})
    finally:
        store.kill()
    # `fleet download` from it: one line naming the destination, exit 1
    assert down.returncode == 1 and "Traceback" not in down.stderr, down.stdout + down.stderr
    assert down.stderr.strip().splitlines()[-1].startswith(f"error: destination {url}: "), down.stderr
    assert up.returncode == 1, up.stdout + up.stderr
    last = up.stderr.strip().splitlines()[-1]
    assert last == f"error: preflight refused: local: destination {url}: {says.format(port=store.port)}"
    assert not (tmp_path / "fleet" / "r" / "shards").exists()          # no shard was launched


def test_a_host_writing_to_two_disks_ships_to_a_shared_folder_that_trains_as_it_is(tmp_path, dense_model, rows):
    """[run] output on two disks and a destination that is a path (an NFS mount): two shards write
    their samples' bytes to both disks in turn, ship them within keep_local, and the destination
    is one dataset — speculators' prepared rows included — read there with no step between."""
    disks = [str(tmp_path / "nvme0" / "run"), str(tmp_path / "nvme1" / "run")]
    dest = str(tmp_path / "nfs" / "run")
    config = local_toml(tmp_path, f"""[run]
name = "r"
model = {json.dumps(dense_model)}
data = {json.dumps(rows)}
output = {json.dumps(disks)}
device = "cpu"
max_tokens_per_batch = 512
destination = {json.dumps(dest)}
keep_local = "{2 * KEEP}"
env = {{ OMP_NUM_THREADS = "1" }}
""")
    text = open(config).read()
    open(config, "w").write(text.replace("gpus = [0]", "gpus = [0, 1]"))
    up = fleet("up", "--headless", "-c", config, timeout=900)
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    spilled = [json.loads(line) for k in (0, 1)
               for line in open(tmp_path / "fleet" / "r" / "shards" / str(k) / "events.jsonl")]
    assert max(e["local_bytes"] for e in spilled if e["event"] == "shipping") <= KEEP   # each shard's share
    assert not [n for d in disks for n in os.listdir(d) if n.startswith("hs_")]          # nothing left, no link
    assert len([n for n in os.listdir(dest) if n.startswith("hs_")]) == ROWS
    v = fleet("verify", "-c", config, timeout=300)
    assert v.returncode == 0 and f"{ROWS} written" in v.stdout and "verify: OK" in v.stdout, v.stdout + v.stderr
    pytest.importorskip("speculators.train.data")
    from speculators.train.data import ArrowDataset
    ds = ArrowDataset(max_len=4096, datapath=os.path.join(dest, "prepared"), on_missing="raise")
    assert len(ds) == ROWS and all(ds[k]["loss_mask"].sum() > 0 for k in range(len(ds)))


def test_a_destination_has_an_owner_and_a_lost_one_is_shipped_again_and_redone(tmp_path, dense_model, rows):
    """Issue 53. A run finishes into s3://bucket/shared: its owner record is there. A second run
    (another name, other rows) given that destination — or a prefix inside it, or the bucket above
    it — is refused at preflight naming the first run, and nothing of the first changes. The first
    run's destination folder then deleted: verify says so (not "redo the run"), --repair ships
    meta.json back and marks every lost row to redo, up redoes them, verify is OK. A download
    into a folder holding something else is refused, never merged."""
    from worker.demo import make_token_dataset
    store = S3Store(str(tmp_path / "store")).start()
    env = {**os.environ, **store.env()}

    def toml(name: str, data: str, url: str, where: str) -> str:
        folder = tmp_path / where
        folder.mkdir(exist_ok=True)
        return local_toml(folder, f"""[run]
name = "{name}"
model = {json.dumps(dense_model)}
data = {json.dumps(data)}
output = "out"
device = "cpu"
max_tokens_per_batch = 512
reference_checks = "off"
destination = "{url}"
""")
    try:
        first = toml("r1", rows, "s3://bucket/shared", "first")
        up = fleet("up", "--headless", "-c", first, timeout=900, env=env)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        owner = json.load(open(os.path.join(store.bucket_dir("shared"), ".fleet", "owner.json")))
        assert owner["run"] == "r1"
        meta = open(os.path.join(store.bucket_dir("shared"), "meta.json")).read()
        other = make_token_dataset(str(tmp_path / "other.jsonl"), 40, vocab_size=500, mean_tokens=20, seed=8)
        for url, says in (("s3://bucket/shared", "destination s3://bucket/shared belongs to run 'r1' (its "
                                                 ".fleet/owner.json, first shipped from "),
                          ("s3://bucket/shared/inner", "destination s3://bucket/shared/inner is inside run 'r1''s "
                                                       "destination bucket/shared: no prefix holds two runs"),
                          ("s3://bucket", "destination s3://bucket holds run 'r1''s destination shared below it")):
            r = fleet("up", "--headless", "-c", toml("r2", other, url, "second"), timeout=300, env=env)
            assert r.returncode == 1 and says in r.stderr.strip().splitlines()[-1], (url, r.stderr[-2000:])
            assert not (tmp_path / "second" / "fleet" / "r2" / "shards").exists()     # nothing launched
        assert open(os.path.join(store.bucket_dir("shared"), "meta.json")).read() == meta
        from worker.ship import Destination, destination, rclone
        bucket = destination("s3://bucket", environ=env)               # through the store's own API
        bucket = Destination(bucket.url, bucket.remote, {**bucket.env, **store.env()})
        (tmp_path / "0.jsonl").write_text('{"index": 0, "tokens": 3}\n')  # output of nobody known
        assert rclone(bucket, "copyto", str(tmp_path / "0.jsonl"), bucket.under("stray/manifest/0.jsonl"),
                      timeout=60).returncode == 0
        r = fleet("up", "--headless", "-c", toml("r2", other, "s3://bucket/stray", "second"), timeout=300, env=env)
        assert r.returncode == 1 and "destination s3://bucket/stray holds manifests (0.jsonl) but neither an owner " \
            "record nor a meta.json" in r.stderr, r.stderr[-2000:]
        v = fleet("verify", "-c", first, timeout=300, env=env)
        assert v.returncode == 0 and "verify: OK" in v.stdout, v.stdout + v.stderr
        # The destination's folder lost: verify names it, --repair ships meta.json back and marks
        # every lost row to redo; up redoes them.
        gone = rclone(bucket, "delete", bucket.remote, "--include", "/shared/**", timeout=120)
        assert gone.returncode == 0, gone.stderr
        assert not store.files("shared")
        v = fleet("verify", "-c", first, timeout=300, env=env)
        assert v.returncode == 1 and "no meta.json at the destination s3://bucket/shared" in v.stdout, v.stdout
        assert "redo the run into a new output" not in v.stdout
        r = fleet("verify", "--repair", "-c", first, timeout=300, env=env)
        assert f"shard 0: {ROWS} sample(s) to redo" in r.stdout, r.stdout + r.stderr
        up = fleet("up", "--headless", "-c", first, timeout=900, env=env)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        v = fleet("verify", "-c", first, timeout=300, env=env)
        assert v.returncode == 0 and f"{ROWS} written" in v.stdout and "verify: OK" in v.stdout, v.stdout + v.stderr
        # fleet download: a folder holding other things, or another destination's download, refused
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "notes.txt").write_text("mine\n")
        d = fleet("download", str(mine), "-c", first, timeout=300, env=env)
        assert d.returncode == 1 and f"{mine} is not empty (notes.txt) and is no download of fleet's" in d.stderr, d.stderr
        assert os.listdir(mine) == ["notes.txt"]
        dl = tmp_path / "dl"
        assert fleet("download", str(dl), "-c", first, timeout=300, env=env).returncode == 0
        d = fleet("download", str(dl), "-c", toml("r3", other, "s3://bucket/elsewhere", "third"), timeout=300, env=env)
        assert d.returncode == 1 and "holds the download of 's3://bucket/shared'" in d.stderr, d.stderr
    finally:
        store.kill()
