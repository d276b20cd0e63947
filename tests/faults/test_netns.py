"""A host behind a network link we can cut: a network namespace with its own sshd, joined to this
one by a veth pair. Cut the link mid-run and restore it: the workers keep running, fleet shows the
host UNKNOWN (not zero), reconnects within the backoff cap, re-attaches, starts nothing twice, and
the run completes and verifies."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from tests.conftest import REPO, wait_for
from tests.sshd_server import start_sshd


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def netns_host(tmp_path):
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root (CI runs as root)")
    tag = os.getpid() % 100000
    ns, vh, vn = f"fleet{tag}", f"fvh{tag}", f"fvn{tag}"
    octet = 10 + tag % 200
    host_ip, ns_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
    ip("netns", "add", ns)
    proc = None
    try:
        ip("link", "add", vh, "type", "veth", "peer", "name", vn)
        ip("link", "set", vn, "netns", ns)
        ip("addr", "add", f"{host_ip}/24", "dev", vh)
        ip("link", "set", vh, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{ns_ip}/24", "dev", vn)
        ip("netns", "exec", ns, "ip", "link", "set", vn, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        server, proc = start_sshd(str(tmp_path / "sshd"), address=ns_ip, prefix=("ip", "netns", "exec", ns))
        yield {"server": server, "link": vh, "ns": ns}
    finally:
        if proc is not None:
            proc.terminate()
        pids = ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        ip("link", "del", vh, check=False)
        ip("netns", "del", ns, check=False)


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
