"""fleet through a real sshd on 127.0.0.1: deploy, preflight, launch, supervise, restart, verify, and
the ways a host can refuse us. Real worker processes on a tiny model on the CPU."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import threading

import jsonschema
import pytest

from tests.conftest import wait_for
from tests.fleet.conftest import fleet, fleet_popen, fleet_toml, supervisor_info
from tests.sshd_server import free_port, keygen
from worker import protocol

pytestmark = pytest.mark.ssh


class Output:
    """Collects a process's output lines in the background."""

    def __init__(self, proc):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def has(self, *parts: str) -> bool:
        return any(all(p in line for p in parts) for line in self.lines)

    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def token_rows(tmp_path):
    from worker.demo import make_token_dataset
    return lambda n, mean=40: make_token_dataset(str(tmp_path / f"data-{n}.jsonl"), n, vocab_size=500,
                                                 mean_tokens=mean, seed=11)


def cfg(tmp_path, sshd, model, data, **kw):
    return fleet_toml(tmp_path, model=model, data=data, port=sshd.port, client_key=sshd.client_key,
                      known_hosts=sshd.known_hosts, **kw)


def launches(tmp_path, shard: int) -> list[dict]:
    path = os.path.join(str(tmp_path), "remote", "fleet", "t", "shards", str(shard), "events.jsonl")
    return [e for e in map(json.loads, open(path)) if e["event"] == "launch"]


def manifest(tmp_path) -> list[int]:
    return [json.loads(l)["index"] for p in glob.glob(os.path.join(str(tmp_path), "remote", "out", "manifest", "*"))
            for l in open(p) if l.strip()]


def test_up_headless_to_done_then_status_and_verify(tmp_path, sshd, dense_model, token_rows):
    config = cfg(tmp_path, sshd, dense_model, token_rows(120))
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "\nbox " in r.stderr and r.stderr.split("\nbox ")[1].split("\n")[0].endswith("ok")  # preflight table
    for shard in (0, 1):
        assert f"shard {shard} box:{shard} RUNNING -> DONE 60/60" in r.stdout
    st = fleet("status", "--json", "-c", config)
    assert st.returncode == 0, st.stderr
    snap = json.loads(st.stdout)
    assert snap["schema"] == "fleet.status/3"
    schema = json.loads(fleet("status", "--json-schema").stdout)       # what the README documents
    jsonschema.validate(snap, schema)
    assert [s["state"] for s in snap["shards"]] == ["DONE", "DONE"]
    assert snap["totals"]["done"] == 120 and snap["totals"]["total"] == 120
    host = snap["hosts"][0]
    assert host["reachable"] is True and isinstance(host["disk"]["free"], int)
    assert host["telemetry"] in ("none", "nvml", "nvidia-smi")
    if host["telemetry"] == "none":
        assert host["gpus"] == []
    text = fleet("status", "-c", config)
    assert "DONE 2" in text.stdout and ("no GPU telemetry" in text.stdout or "gpu0" in text.stdout)
    assert text.stdout.startswith("run t: finished, 2/2 shards DONE in ") and "fleet verify" in text.stdout
    assert text.returncode == 0 and "ETA" not in text.stdout.splitlines()[0]
    v = fleet("verify", "-c", config)
    assert v.returncode == 0 and "120 written" in v.stdout and "verify: OK" in v.stdout
    # The deployed worker is content-hashed: a second up uploads nothing and starts nothing.
    again = fleet("up", "--headless", "-c", config)
    assert again.returncode == 0
    assert len(launches(tmp_path, 0)) == 1 and len(launches(tmp_path, 1)) == 1
    assert len(glob.glob(os.path.join(str(tmp_path), "remote", "fleet", "t", "code", "*"))) == 1
    # The run is finished and no client is left: its supervisor goes by itself (the commands below
    # then read the hosts themselves).
    wait_for(lambda: supervisor_info(config) is None, 30, what="the finished run's supervisor to go")
    # fleet upgraded here: the host holds the run's worker only under another version's hash (and
    # its python has no fleet of its own, tests/host_python.py). Each command puts this fleet's back.
    [code] = glob.glob(os.path.join(str(tmp_path), "remote", "fleet", "t", "code", "*"))
    said = {"status": lambda out: [s["state"] for s in json.loads(out)["shards"]] == ["DONE", "DONE"],
            "verify": lambda out: "verify: OK" in out, "logs": lambda out: "done" in out.lower()}
    for command in (("status", "--json"), ("verify",), ("logs", "0")):
        shutil.rmtree(os.path.join(os.path.dirname(code), "0ld0ld0ld0ld0ld0"), ignore_errors=True)
        os.rename(code, os.path.join(os.path.dirname(code), "0ld0ld0ld0ld0ld0"))
        r = fleet(*command, "-c", config)
        assert r.returncode == 0 and said[command[0]](r.stdout), (command, r.stdout + r.stderr)
        assert os.path.isfile(os.path.join(code, "worker", "protocol", "__init__.py")), command


def test_sigkilled_worker_fails_restarts_resumes_and_completes(tmp_path, sshd, dense_model, token_rows):
    config = cfg(tmp_path, sshd, dense_model, token_rows(3000, mean=50))
    proc = fleet_popen("up", "--headless", "-c", config)
    out = Output(proc)
    try:
        pid_file = os.path.join(str(tmp_path), "remote", "fleet", "t", "shards", "0", "pid")
        wait_for(lambda: out.has("shard 0", "-> RUNNING"), 120, what="shard 0 running")
        wait_for(lambda: len(manifest(tmp_path)) >= 50, 120, what="some samples written")
        pid = int(open(pid_file).read())
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(300) == 0, out.text()
    finally:
        if proc.poll() is None:
            proc.kill()
    out.thread.join(5)
    assert out.has("shard 0", "RUNNING -> BACKOFF", "killed by signal 9; restart in 0.5s"), out.text()
    assert out.has("shard 0", "BACKOFF -> STARTING"), out.text()
    assert out.has("shard 0", "-> DONE") and out.has("shard 1", "-> DONE"), out.text()
    assert [e["by"] for e in launches(tmp_path, 0)] == ["manual", "auto"]
    assert sorted(manifest(tmp_path)) == list(range(3000))                    # resumed: nothing twice
    v = fleet("verify", "-c", config)
    assert v.returncode == 0, v.stdout
    st = json.loads(fleet("status", "--json", "-c", config).stdout)
    assert st["shards"][0]["restarts"] == 1 and st["shards"][1]["restarts"] == 0
    # The host's two GPUs share their rows (worker/leases.py): shard 1 may have done some of shard
    # 0's while it restarted, but between them every row once.
    assert sum(s["done"] for s in st["shards"]) == 3000 and st["totals"]["finished"] is True
    assert st["shards"][0]["rows_moved_out"] == st["shards"][1]["rows_moved_in"]


def test_supervisor_sigkilled_mid_run_then_up_starts_one_that_goes_on_without_starting_twice(
        tmp_path, sshd, dense_model, token_rows):
    config = cfg(tmp_path, sshd, dense_model, token_rows(3000, mean=50))
    first = fleet_popen("up", "--headless", "-c", config)
    out = Output(first)
    try:
        wait_for(lambda: out.has("shard 1", "-> RUNNING") and out.has("shard 0", "-> RUNNING"), 120,
                 what="both shards running")
        info = supervisor_info(config)
        os.kill(info.pid, signal.SIGKILL)                 # the run's supervisor, not its client
        assert first.wait(30) == 1 and "the run's supervisor stopped" in out.text(), out.text()
    finally:
        if first.poll() is None:
            first.kill()
    pids = [int(open(os.path.join(str(tmp_path), "remote", "fleet", "t", "shards", str(k), "pid")).read())
            for k in (0, 1)]
    for pid in pids:
        os.kill(pid, 0)                                   # the workers outlived their supervisor
    st = fleet("status", "--json", "-c", config)         # no supervisor: read from the hosts, saying so
    assert st.returncode == 0 and "no supervisor runs for run t here" in st.stderr, st.stderr
    assert {s["state"] for s in json.loads(st.stdout)["shards"]} <= {"RUNNING", "LOADING", "DONE"}
    again = fleet("up", "--headless", "-c", config)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "starting the run's supervisor" in again.stderr and "launch (manual): started" not in again.stderr
    for k in (0, 1):
        assert len(launches(tmp_path, k)) == 1
    assert not re.search(r"-> (STALLED|FAILED|BACKOFF|FATAL|UNKNOWN)", again.stdout), again.stdout
    assert sorted(manifest(tmp_path)) == list(range(3000))


def test_restart_logs_and_down_commands(tmp_path, sshd, dense_model, token_rows):
    # Rows enough that the run is still going when `down` comes: the two shards share their rows,
    # so a restarted shard's rest no longer holds the run open on its own.
    config = cfg(tmp_path, sshd, dense_model, token_rows(20000, mean=50))
    proc = fleet_popen("up", "--headless", "-c", config)
    out = Output(proc)
    try:
        wait_for(lambda: out.has("shard 0", "-> RUNNING"), 120, what="shard 0 running")
        proc.send_signal(signal.SIGKILL)                  # the client goes; its supervisor stays
        proc.wait(10)
        assert supervisor_info(config) is not None
        logs = fleet("logs", "box:0", "-c", config)       # each command a client of that supervisor
        assert logs.returncode == 0 and "[shard 0]" in logs.stdout
        rs = fleet("restart", "0", "-c", config)
        assert rs.returncode == 0 and "shard 0: started" in rs.stdout, rs.stdout + rs.stderr
        assert [e["by"] for e in launches(tmp_path, 0)] == ["manual", "manual"]
        bad = fleet("restart", "7", "-c", config)
        assert bad.returncode == 2 and "no shard '7'" in bad.stderr
        no = fleet("down", "-c", config, input="n\n")
        assert no.returncode == 1 and "nothing stopped" in no.stderr
        down = fleet("down", "--yes", "-c", config)
        assert down.returncode == 0 and "box: stopped" in down.stdout, down.stdout + down.stderr
        assert "(0" in down.stdout                          # shard 0 was live (just restarted)
        st = fleet("status", "--json", "-c", config)
        snap = json.loads(st.stdout)
        assert snap["shards"][0]["reason"] == "stopped" and snap["shards"][0]["state"] == "STOPPED"
        assert snap["shards"][1]["state"] in ("DONE", "STOPPED")
        assert all(s["alive"] is False for s in snap["shards"]) and st.returncode == 0   # stopped: not a fault
        again = fleet("down", "-c", config)                 # nothing live: nothing to ask
        assert again.returncode == 0 and "nothing is running or waiting to restart; nothing to stop" in again.stdout, again.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        fleet("down", "--yes", "-c", config)


def test_host_key_unknown_changed_accept_new_and_closed_port(tmp_path, sshd, dense_model, token_rows):
    data = token_rows(10)
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    config = fleet_toml(tmp_path, model=dense_model, data=data, port=sshd.port, client_key=sshd.client_key,
                        known_hosts=str(empty))
    r = fleet("status", "-c", config)
    assert r.returncode == 3
    assert "host key unknown" in r.stdout + r.stderr and "ssh-keyscan -p" in r.stdout + r.stderr
    import asyncssh
    fingerprint = asyncssh.import_public_key(sshd.host_pub).get_fingerprint()
    assert fingerprint in r.stdout + r.stderr                                # the key it offers, named
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode == 3 and "host key unknown" in r.stderr and "Traceback" not in r.stderr

    other = keygen(str(tmp_path / "other"))
    changed = tmp_path / "changed_known_hosts"
    changed.write_text(f"[127.0.0.1]:{sshd.port} {' '.join(other.split()[:2])}\n")
    config = fleet_toml(tmp_path, model=dense_model, data=data, port=sshd.port, client_key=sshd.client_key,
                        known_hosts=str(changed), extra_host="accept_new = true")
    r = fleet("status", "--json", "-c", config)
    assert r.returncode == 3
    host = json.loads(r.stdout)["hosts"][0]
    assert host["reachable"] is False and "CHANGED" in host["error"]       # accept_new never trusts a change

    new = tmp_path / "new_known_hosts"
    config = fleet_toml(tmp_path, model=dense_model, data=data, port=sshd.port, client_key=sshd.client_key,
                        known_hosts=str(new), extra_host="accept_new = true")
    r = fleet("status", "-c", config)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sshd.host_pub.split()[1] in new.read_text()

    config = fleet_toml(tmp_path, model=dense_model, data=data, port=free_port(), client_key=sshd.client_key,
                        known_hosts=sshd.known_hosts)
    r = fleet("status", "--json", "-c", config)
    assert r.returncode == 3 and "connection refused" in json.loads(r.stdout)["hosts"][0]["error"]
    r = fleet("status", "-c", config)                 # no host to read the plan from: says so
    assert r.returncode == 3 and "host box: unreachable (" in r.stdout and "shards: unknown" in r.stdout, r.stdout
    # A closed port is a closed port, whatever the known_hosts file says or whether it exists.
    closed = free_port()
    for known, extra in ((tmp_path / "absent_known_hosts", ""), (tmp_path / "absent2", "accept_new = true"),
                         (empty, "accept_new = true")):
        config = fleet_toml(tmp_path, model=dense_model, data=data, port=closed, client_key=sshd.client_key,
                            known_hosts=str(known), extra_host=extra)
        r = fleet("up", "--headless", "-c", config)
        assert r.returncode == 3 and "connection refused" in r.stderr, (extra, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and "host key" not in r.stderr


def test_a_host_without_user_logs_in_as_the_local_user(tmp_path, sshd, dense_model, token_rows):
    """`user` left out means what it means to ssh: the local user name."""
    config = cfg(tmp_path, sshd, dense_model, token_rows(10))
    text = open(config).read()
    assert 'user = "root"\n' in text
    open(config, "w").write(text.replace('user = "root"\n', ""))
    r = fleet("status", "--json", "-c", config, env={**os.environ, "USER": "root", "LOGNAME": "root"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["hosts"][0]["reachable"] is True


def test_preflight_refuses_missing_paths(tmp_path, sshd, dense_model):
    config = cfg(tmp_path, sshd, dense_model, str(tmp_path / "no-such-data.jsonl"))
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode == 1
    assert "preflight refused: box: data path" in r.stderr and "does not exist" in r.stderr


def test_the_seed_users_own_job_through_ssh_fails_then_is_restarted_to_done(tmp_path, sshd):
    """Their per-GPU script under [job]: `processed i/N` lines, `extract-only mode` at the end; one
    shard prints ERROR and exits 1. up exits 1 with it FATAL (its reason quoting the line) and the
    other DONE; with the cause removed, `fleet restart` brings it to DONE and up exits 0."""
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs",
                          "extract_hidden_states.py")
    marker = tmp_path / "gpu-is-broken"
    marker.write_text("")
    job = f"""
[job]
command = "{{python}} {script} --shard {{shard}} --num-shards {{num_shards}} --out {{output}} --fail-marker {marker}"
done = "extract-only mode"
fail = "FAIL|ERROR"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"
"""
    config = cfg(tmp_path, sshd, None, None, job=job, max_restarts=2)
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "shard 0 box:0 RUNNING -> DONE 20/20" in r.stdout
    fatal = [l for l in r.stdout.splitlines() if "shard 1 box:1" in l and "-> FATAL" in l]
    assert fatal and "gave up after 2 restart(s); last: fail sentinel: ERROR: CUDA error: an illegal " \
                     "memory access was encountered" in fatal[0], r.stdout
    st = json.loads(fleet("status", "--json", "-c", config).stdout)
    assert [s["state"] for s in st["shards"]] == ["DONE", "FATAL"]
    assert st["shards"][1]["restarts"] == 2 and st["shards"][1]["done"] == 9
    done = fleet("restart", "0", "-c", config)                        # DONE: nothing to redo
    assert done.returncode == 1 and "shard 0 is DONE: nothing to redo" in done.stderr, done.stdout + done.stderr
    marker.unlink()                                                   # the cause removed
    rs = fleet("restart", "1", "-c", config)
    assert rs.returncode == 0 and "shard 1: started" in rs.stdout, rs.stdout + rs.stderr
    again = fleet("up", "--headless", "-c", config)
    assert again.returncode == 0, again.stdout + again.stderr
    st = json.loads(fleet("status", "--json", "-c", config).stdout)
    assert [(s["state"], s["done"], s["total"]) for s in st["shards"]] == [("DONE", 20, 20), ("DONE", 20, 20)]
    assert len(glob.glob(os.path.join(str(tmp_path), "remote", "out", "hs_*.safetensors"))) == 40
    assert [e["by"] for e in launches(tmp_path, 1)] == ["manual", "auto", "auto", "manual"]


def tiny_job(tmp_path) -> str:
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs",
                          "extract_hidden_states.py")
    return f"""
[job]
command = "{{python}} {script} --shard {{shard}} --num-shards {{num_shards}} --out {{output}} --rows 6"
done = "extract-only mode"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"
"""


def test_deploy_needs_no_sftp_subsystem(tmp_path):
    from tests.sshd_server import start_sshd
    server, proc = start_sshd(str(tmp_path / "sshd"), sftp=False)
    try:
        config = fleet_toml(tmp_path, model=None, data=None, port=server.port, client_key=server.client_key,
                            known_hosts=server.known_hosts, job=tiny_job(tmp_path))
        r = fleet("up", "--headless", "-c", config)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "uploaded" in r.stderr and r.stdout.count("-> DONE 3/3") == 2
    finally:
        proc.terminate()
        proc.wait(10)


def test_an_agent_that_fails_or_speaks_another_protocol_says_why(tmp_path, sshd):
    config = cfg(tmp_path, sshd, None, None, job=tiny_job(tmp_path), gpus=(0,))
    assert fleet("up", "--headless", "-c", config).returncode == 0
    run_dir = os.path.join(str(tmp_path), "remote", "fleet", "t")
    # A record the agent cannot read (a folder where the file should be): the agent dies, and the
    # host row says why instead of "unreachable".
    events = os.path.join(run_dir, "shards", "0", "events.jsonl")
    os.rename(events, events + ".bak")
    os.mkdir(events)
    r = fleet("status", "--json", "-c", config)
    host = json.loads(r.stdout)["hosts"][0]
    assert r.returncode == 3 and host["reachable"] is False
    assert host["error"].startswith("agent failed: IsADirectoryError"), host["error"]
    os.rmdir(events)
    os.rename(events + ".bak", events)
    # The deployed worker speaks another protocol version: refused, with what to do.
    [code] = glob.glob(os.path.join(run_dir, "code", "*", "worker", "protocol", "layout.py"))
    text = open(code).read()
    current = f"PROTOCOL_VERSION = {protocol.PROTOCOL_VERSION}"
    assert current in text
    open(code, "w").write(text.replace(current, "PROTOCOL_VERSION = 1"))
    r = fleet("status", "--json", "-c", config)
    host = json.loads(r.stdout)["hosts"][0]
    assert r.returncode == 3
    assert host["error"] == f"host runs worker protocol 1, this fleet speaks {protocol.PROTOCOL_VERSION}: " \
                            "redeploy (fleet up)"
