"""A host behind a network link we can cut: a network namespace with its own sshd, joined to this
one by a veth pair. Cut the link mid-run and restore it: the workers keep running, fleet shows the
host UNKNOWN (not zero), reconnects within the backoff cap, re-attaches, starts nothing twice, and
the run completes and verifies."""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.conftest import REPO, read_events, wait_for
from tests.sshd_server import start_sshd


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@contextlib.contextmanager
def netns_link():
    """A network namespace joined to this one by a veth pair: (namespace, this side's link, this
    side's address, the namespace's address). Cut it with `ip link set <link> down`."""
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root (CI runs as root)")
    tag = (os.getpid() + next(_serial)) % 100000
    ns, vh, vn = f"fleet{tag}", f"fvh{tag}", f"fvn{tag}"
    octet = 10 + tag % 200
    host_ip, ns_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
    ip("netns", "add", ns)
    try:
        ip("link", "add", vh, "type", "veth", "peer", "name", vn)
        ip("link", "set", vn, "netns", ns)
        ip("addr", "add", f"{host_ip}/24", "dev", vh)
        ip("link", "set", vh, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/24", "dev", vn)
        ip("netns", "exec", ns, "ip", "link", "set", vn, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, vh, host_ip, ns_ip
    finally:
        for pid in ip("netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        ip("link", "del", vh, check=False)
        ip("netns", "del", ns, check=False)


_serial = itertools.count()


@pytest.fixture
def netns_host(tmp_path):
    with netns_link() as (ns, link, _, ns_ip):
        server, proc = start_sshd(str(tmp_path / "sshd"), address=ns_ip, prefix=("ip", "netns", "exec", ns))
        try:
            yield {"server": server, "link": link, "ns": ns}
        finally:
            proc.terminate()


def test_link_cut_and_restored_mid_run(tmp_path, netns_host, dense_model):
    from worker.demo import make_token_dataset
    from tests.fleet.conftest import fleet_toml
    server = netns_host["server"]
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 6000, vocab_size=500, mean_tokens=50, seed=8)
    config = fleet_toml(tmp_path, model=dense_model, data=data, port=server.port, client_key=server.client_key,
                        known_hosts=server.known_hosts, address=server.address,
                        supervise='keepalive_interval = "1s"\nkeepalive_count_max = 2\nreconnect_max = "4s"')
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "up", "--headless", "-c", config], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(l.rstrip() for l in proc.stdout), daemon=True).start()
    has = lambda *parts: any(all(p in l for p in parts) for l in lines)
    try:
        wait_for(lambda: has("shard 0", "-> RUNNING") and has("shard 1", "-> RUNNING"), 180, what="running")
        pid_files = [os.path.join(str(tmp_path), "remote", "fleet", "t", "shards", str(k), "pid") for k in (0, 1)]
        pids = [int(open(p).read()) for p in pid_files]
        ip("link", "set", netns_host["link"], "down")
        wait_for(lambda: has("shard 0", "-> UNKNOWN") and has("shard 1", "-> UNKNOWN"), 60, what="UNKNOWN")
        for pid in pids:
            os.kill(pid, 0)                                   # the workers kept running
        wait_for(lambda: has("unreachable"), 10, what="the reason")
        ip("link", "set", netns_host["link"], "up")
        wait_for(lambda: has("UNKNOWN -> "), 60, what="reconnected and re-attached")
        assert proc.wait(300) == 0, "\n".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "\n".join(lines)
    assert "UNKNOWN -> " in text
    for k in (0, 1):
        events = [json.loads(l) for l in open(os.path.join(str(tmp_path), "remote", "fleet", "t", "shards",
                                                            str(k), "events.jsonl"))]
        assert [e["by"] for e in events if e["event"] == "launch"] == ["manual"], "started twice"
    indices = [json.loads(l)["index"] for p in glob.glob(os.path.join(str(tmp_path), "remote", "out", "manifest", "*"))
               for l in open(p) if l.strip()]
    assert sorted(indices) == list(range(6000))
    v = subprocess.run([sys.executable, "-m", "fleet.cli", "verify", "-c", config], cwd=REPO,
                       capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr


def test_the_store_cut_off_by_the_network_pauses_shipping_and_loses_nothing(tmp_path, dense_model):
    """The object store behind a link cut mid-run (no refusal, no reset: packets vanish) and then
    restored: shipping waits and resumes, nothing leaves the local disk that the store does not
    hold, the local bound holds, nothing counts twice, and the shard never fails for it."""
    from tests.s3_store import S3Store
    from tests.worker.test_ship import KEEP, extract, local_samples, nothing_lost, written
    from worker.demo import make_chat_dataset
    rows = make_chat_dataset(str(tmp_path / "chat.jsonl"), 240, mean_words=30)
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    with netns_link() as (ns, link, _, ns_ip):
        store = S3Store(str(tmp_path / "store"), address=ns_ip, prefix=("ip", "netns", "exec", ns)).start()
        proc = extract(dense_model, rows, out, state, "s3://bucket/run", store.env(), "--random-weights")
        try:
            shipping = lambda: [e for e in read_events(state) if e["event"] == "shipping"]  # noqa: E731
            wait_for(lambda: any(e["shipped_files"] > 0 for e in shipping()), 120, what="first files shipped")
            ip("link", "set", link, "down")
            wait_for(lambda: any(e.get("waiting") for e in shipping()[-3:]), 180, what="the writer waiting")
            nothing_lost(out, store, rounds=10)   # cut off
            assert proc.poll() is None       # waiting, not failed
            ip("link", "set", link, "up")
            _, err = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
            store.kill()
    assert proc.returncode == 0, err[-2000:]
    events = read_events(state)
    assert not [e for e in events if e["event"] == "failed"]
    recorded = written(out)
    assert len(recorded) == 240 and local_samples(out) == {}
    assert {k: v for k, v in store.files("run").items() if k.startswith("hs_")} == \
        {f"hs_{i}.safetensors": n for i, n in recorded.items()}
    told = [e for e in events if e["event"] == "shipping"]
    assert told[-1]["finished"] and told[-1]["shipped_files"] == 240     # each counted once
    assert max(e["local_bytes"] for e in told) <= KEEP
