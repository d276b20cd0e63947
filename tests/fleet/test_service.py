"""The run supervises itself (issue 52): its supervisor (fleet/service.py) outlives its clients, no
host locks anyone out, a host with no live GPU gives its rows away, a host back after the run is
told, and clients join in a second — through the real CLI, real sshds on 127.0.0.1, real workers
on the tiny model and real [job]s, over many clients and a supervisor killed mid-run."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from fleet import control
from fleet.client import Client
from fleet.config import load_config
from fleet.relocate import HostFacts, Moves, orders
from fleet.runhome import RunHome
from fleet.state import State
from fleet.store import idle_host
from tests.conftest import REPO, host_python, read_events, wait_for
from tests.fleet.conftest import (LOST_AFTER, fleet, fleet_popen, hosts_toml, stop_supervisor, supervisor_info,
                                  two_hosts, up_headless)
from tests.fleet.test_relocate import manifest_counts
from tests.sshd_server import cut, serve

ROWS_JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "rows_job.py")
SCRIPTED_JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "scripted_job.py")
BAD = re.compile(r"-> (STALLED|FAILED|BACKOFF|FATAL|UNKNOWN)")


def rows_job(rows: int, sleep: float) -> str:
    return f"""[job]
command = "{{python}} {ROWS_JOB} {{output}} {{start}} {{end}} {{shard}} --sleep {sleep}"
done = "ALL DONE"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"
rows = {rows}
min_chunk = 4
"""


def events(tmp_path, host: str, k: int) -> list[dict]:
    return read_events(str(tmp_path / f"root-{host}" / "t" / "shards" / str(k)))


def rows_done(out) -> list[int]:
    path = os.path.join(str(out), "rows.txt")
    return [int(line.split()[0]) for line in open(path)] if os.path.exists(path) else []


# --- pure: the decision for a host that can do nothing more ------------------------------------

def test_a_host_whose_every_shard_gave_up_holding_rows_is_idle_and_only_then():
    F, S, D, R = State.FATAL, State.STOPPED, State.DONE, State.RUNNING
    assert idle_host([(F, True)]) and idle_host([(F, True), (D, False)]) and idle_host([(S, True), (F, False)])
    assert not idle_host([]) and not idle_host([(F, False)]) and not idle_host([(D, True)])
    assert not idle_host([(F, True), (R, True)]) and not idle_host([(F, True), (State.BACKOFF, True)])


def test_an_idle_host_is_counted_then_its_unfinished_rows_adopted_then_it_is_told():
    def facts(name, shards, idle=False, unfinished=None, usable=True, planned=()):
        return HostFacts(name, tuple(shards), False, usable, True, 7, tuple(planned), idle=idle, unfinished=unfinished)
    moves = Moves()
    hosts = [facts("a", [0, 1], planned=[(0, 100)]), facts("b", [2], idle=True, planned=[(100, 150)])]
    [count] = orders(hosts, moves)
    assert (count.kind, count.host, count.why) == ("count", "b", "idle")
    hosts[1] = facts("b", [2], idle=True, unfinished=((120, 150),), planned=[(100, 150)])
    [adopt] = orders(hosts, moves)                      # only what it has not done, none redone
    assert (adopt.kind, adopt.host, adopt.runs, adopt.redone, adopt.why) == ("adopt", "a", ((120, 150),), 0, "idle")
    moves.ask(adopt, 1.0)
    assert orders(hosts, moves) == []                   # asked: not twice
    from worker import protocol
    moves.seen(protocol.Relocated(start=120, stop=150, from_host="b", to_host="a", side="in", why="idle", t=2.0))
    [revoke] = orders(hosts, moves)                     # reachable: told at once
    assert (revoke.kind, revoke.host, revoke.runs, revoke.why) == ("revoke", "b", ((120, 150),), "idle")
    # a host whose every shard gave up gives nothing to another such host
    assert orders([facts("a", [0], idle=True, unfinished=((0, 5),)), facts("b", [1], idle=True, unfinished=((5, 9),))],
                  Moves()) == []


# --- the supervisor outlives its client ---------------------------------------------------------

def test_a_run_stays_supervised_after_its_client_is_killed_and_a_client_joins_it_without_a_deploy(tmp_path):
    """`fleet up --headless` SIGKILLed mid-run: a worker killed afterwards is restarted with no
    client attached (its record says so), a `fleet up` then joins (no deploy, no preflight) and
    follows the run to its end, and `fleet status --json` from the supervisor agrees with the
    hosts' own records read afresh."""
    with two_hosts(tmp_path) as (servers, procs):
        config = hosts_toml(tmp_path, servers, model=None, data=None, gpus={"a": [0], "b": [0]},
                            output=str(tmp_path / "remote" / "out-{host}"), job=rows_job(300, 0.1))
        up, lines = up_headless(config)
        try:
            wait_for(lambda: all(re.search(rf"shard {k} \w:0 \S+ -> RUNNING", "\n".join(lines)) for k in (0, 1)),
                     120, what="both shards running")
            up.send_signal(signal.SIGKILL)
            up.wait(10)
        finally:
            if up.poll() is None:
                up.kill()
        info = supervisor_info(config)
        assert info is not None and info.pid != up.pid            # the supervisor is not the client
        pid = int(open(tmp_path / "root-a" / "t" / "shards" / "0" / "pid").read())
        os.kill(pid, signal.SIGKILL)                               # a worker dies with nobody watching
        wait_for(lambda: [e["by"] for e in events(tmp_path, "a", 0) if e["event"] == "launch"] == ["manual", "auto"],
                 60, what="the supervisor to relaunch shard 0 by itself")
        joined = fleet("up", "--headless", "-c", config, timeout=300)
        assert joined.returncode == 0, joined.stdout + joined.stderr
        assert f"joining the run's supervisor (pid {info.pid}" in joined.stderr, joined.stderr
        assert "deploying" not in joined.stderr and "preflight" not in joined.stderr, joined.stderr
        assert "run t: finished" in joined.stdout and "launch (manual)" not in joined.stderr
        rows = rows_done(tmp_path / "remote" / "out-a") + rows_done(tmp_path / "remote" / "out-b")
        assert sorted(set(rows)) == list(range(300))
        assert supervisor_info(config) is None                     # ended, its last client gone
        from_hosts = fleet("status", "--json", "-c", config)      # (read afresh: none runs)
        assert "no supervisor runs" in from_hosts.stderr
        snap = json.loads(from_hosts.stdout)
        assert [(s["state"], s["restarts"]) for s in snap["shards"]] == [("DONE", 1), ("DONE", 0)]


def test_clients_at_once_see_one_state_a_second_supervisor_is_refused_and_down_ends_it(tmp_path):
    """Two `fleet up --headless` and a `status` loop on one live run see one state; a second
    supervisor of the run (a copy of fleet.toml elsewhere, and `fleet serve` beside the first) is
    refused saying where the first runs; `fleet down` through it stops every shard, both clients
    end, and the supervisor goes."""
    root = tmp_path / "hosts-root"
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"0": [[["progress", 1, 100], ["hang"]]], "1": [[["progress", 1, 100], ["hang"]]]}))
    text = f"""
[run]
name = "twice"
output = "{tmp_path / 'out'}"

[supervise]
stop_grace = "1s"

[job]
command = "{{python}} {SCRIPTED_JOB} {script} {{shard}}"
done = "extract-only mode"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"

[[hosts]]
name = "local"
address = "local"
gpus = [0, 1]
root = "{root}"
"""
    config = tmp_path / "fleet.toml"
    config.write_text(text)
    first, first_lines = up_headless(str(config))
    second = None
    try:
        wait_for(lambda: "\n".join(first_lines).count("-> RUNNING") == 2, 120, what="both shards running")
        info = supervisor_info(str(config))
        second, second_lines = up_headless(str(config))
        wait_for(lambda: "joining the run's supervisor" in "\n".join(second_lines), 30, what="the second client")
        for _ in range(5):                                           # a status loop beside them
            r = fleet("status", "--json", "-c", str(config))
            snap = json.loads(r.stdout)
            assert r.returncode == 0 and [s["state"] for s in snap["shards"]] == ["RUNNING", "RUNNING"]
            assert snap["supervisor"].startswith(f"pid {info.pid} here")
        copy = tmp_path / "elsewhere" / "fleet.toml"
        copy.parent.mkdir()
        copy.write_text(text)
        other = fleet("up", "--headless", "-c", str(copy), timeout=120)
        assert other.returncode == 1, other.stdout + other.stderr
        assert f"is supervised by the supervisor pid {info.pid} here" in other.stderr, other.stderr
        assert str(config) in other.stderr and "Traceback" not in other.stderr
        again = fleet("serve", "-c", str(config), timeout=60)
        assert again.returncode == 1 and "is already supervised here" in again.stderr, again.stderr
        assert supervisor_info(str(config)).pid == info.pid               # untouched by either
        assert all(len([e for e in read_events(str(root / "twice" / "shards" / str(k))) if e["event"] == "launch"]) == 1
                   for k in (0, 1))
        down = fleet("down", "--yes", "-c", str(config))
        assert down.returncode == 0 and "local: stopped 2 shard(s) (0, 1)" in down.stdout, down.stdout + down.stderr
        assert first.wait(60) == 1 and second.wait(60) == 1                # stopped, not finished
        for lines in (first_lines, second_lines):
            assert re.search(r"shard 0 local:0 \S+ -> STOPPED", "\n".join(lines)), lines
        wait_for(lambda: supervisor_info(str(config)) is None, 30, what="the supervisor to go")
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
        fleet("down", "--yes", "-c", str(config))


def test_a_broken_request_on_the_control_socket_is_answered_and_the_supervisor_goes_on(tmp_path):
    """The control socket is owner-only; a line that is no request gets an error, not a crash."""
    import asyncio
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"0": [[["progress", 1, 10], ["hang"]]]}))
    config = tmp_path / "fleet.toml"
    config.write_text(f"""
[run]
name = "sock"
output = "out"
[supervise]
stop_grace = "1s"
[job]
command = "{{python}} {SCRIPTED_JOB} {script} {{shard}}"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"
[[hosts]]
name = "local"
address = "local"
gpus = [0]
root = "fleet"
""")
    up, lines = up_headless(str(config))
    try:
        wait_for(lambda: "-> RUNNING" in "\n".join(lines), 120, what="the shard running")
        home = RunHome("sock", str(config))
        assert oct(os.stat(home.socket).st_mode & 0o777) == "0o600" and oct(os.stat(home.dir).st_mode & 0o777) == "0o700"

        async def poke() -> tuple:
            reader, writer = await asyncio.open_unix_connection(home.socket)
            writer.write(b'{"op": "explode"}\nnot json\n')
            answers = [control.parse_message(await reader.readline()) for _ in range(2)]
            writer.close()
            client = await Client.connect(home.socket)
            snap = await client.ask(control.SnapshotRequest())
            await client.close()
            return answers, snap
        answers, snap = asyncio.run(poke())
        assert all(isinstance(a, control.Reply) and a.error and a.code == 2 for a in answers), answers
        assert [s.state for s in snap.snapshot.shards] == [State.RUNNING]
    finally:
        fleet("down", "--yes", "-c", str(config))
        up.wait(60)


# --- no host locks anyone out -------------------------------------------------------------------

def test_a_host_down_at_the_start_is_left_out_of_setup_not_the_run(tmp_path, dense_model):
    """b's sshd is down when `fleet up --headless` starts a new run: a is deployed and runs, b's
    shard is UNKNOWN; after host_lost_after its rows go to a; the run ends finished; b back, `fleet
    verify` tells it where its rows went and passes, with one training command."""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 600, vocab_size=500, mean_tokens=30, seed=5)
    with two_hosts(tmp_path) as (servers, procs):
        config = hosts_toml(tmp_path, servers, model=dense_model, data=data, gpus={"a": [0, 1], "b": [0]},
                            output=str(tmp_path / "remote" / "out-{host}"), supervise=LOST_AFTER)
        cut(procs["b"])
        r = fleet("up", "--headless", "-c", config, timeout=400)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "b: unreachable (" in r.stderr and "supervising the others" in r.stderr, r.stderr
        assert "UNREACHABLE: " in r.stderr                               # b's row in the preflight table
        assert re.search(r"rows [\d,]+–600 of b \(lost\) → a", r.stdout + r.stderr), r.stdout + r.stderr
        assert manifest_counts(str(tmp_path / "remote" / "out-a")) == {i: 1 for i in range(600)}
        snap = json.loads(fleet("status", "--json", "-c", config).stdout)
        assert snap["totals"]["finished"] and snap["shards"][2]["state"] == "UNKNOWN"
        assert not snap["shards"][2]["holds_rows"]
        procs["b"] = serve(servers["b"])
        v = fleet("verify", "-c", config)
        assert v.returncode == 0 and "verify: OK" in v.stdout and "600 written" in v.stdout, v.stdout + v.stderr
        assert "b: back; its rows" in v.stdout and len(re.findall(r"^train \(", v.stdout, re.M)) == 1, v.stdout
        assert [e for e in events(tmp_path, "b", 2) if e["event"] == "relocated"]   # b told, in its record


def failing_python(tmp_path) -> str:
    """A host python whose worker always dies at start (a GPU in a bad state): everything else runs."""
    path = tmp_path / "bad-gpu-python"
    path.write_text(f"""#!/bin/sh
for a in "$@"; do
  if [ "$a" = "worker.extract" ]; then echo "RuntimeError: CUDA error: an illegal memory access was encountered" >&2; exit 1; fi
done
exec {host_python()} "$@"
""")
    path.chmod(0o755)
    return str(path)


def with_python(config: str, host: str, python: str) -> None:
    """Give one [[hosts]] entry of a fleet.toml written by hosts_toml another python."""
    text = open(config).read()
    head, _, rest = text.partition(f'name = "{host}"')
    rest = re.sub(r"python = .*", f"python = {json.dumps(python)}", rest, count=1)
    open(config, "w").write(head + f'name = "{host}"' + rest)


def test_a_host_whose_only_gpu_always_fails_gives_its_rows_to_the_others_and_a_restart_brings_it_back(
        tmp_path, dense_model):
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 600, vocab_size=500, mean_tokens=30, seed=6)
    with two_hosts(tmp_path) as (servers, procs):
        config = hosts_toml(tmp_path, servers, model=dense_model, data=data, gpus={"a": [0, 1], "b": [0]},
                            output=str(tmp_path / "remote" / "out-{host}"))
        with_python(config, "b", failing_python(tmp_path))
        r = fleet("up", "--headless", "-c", config, timeout=400)
        out = r.stdout + r.stderr
        assert r.returncode == 0, out
        assert re.search(r"shard 2 b:0 \S+ -> FATAL", r.stdout), out
        assert "b: no shard of it can go on: counting the rows it has not done" in r.stderr, out
        assert "of b (no shard of it can go on) → a (200 rows)" in r.stderr, out
        assert "b: its rows 400–600 went to a (no shard of it can go on): marking them gone there" in r.stderr, out
        assert manifest_counts(str(tmp_path / "remote" / "out-a")) == {i: 1 for i in range(600)}
        assert manifest_counts(str(tmp_path / "remote" / "out-b")) == {}
        v = fleet("verify", "-c", config)
        assert v.returncode == 0 and "600 written, 0 skipped" in v.stdout and "verify: OK" in v.stdout, v.stdout
        snap = json.loads(fleet("status", "--json", "-c", config).stdout)
        assert snap["totals"]["finished"] and snap["totals"]["rows_relocated"] == 200
        assert snap["shards"][2]["state"] == "FATAL" and not snap["shards"][2]["holds_rows"]
        # The card is fixed; `r` brings the slot back: its rows went to a, so it ends at once, writing none.
        with_python(config, "b", host_python())
        rs = fleet("restart", "2", "-c", config)
        assert rs.returncode == 0, rs.stdout + rs.stderr
        wait_for(lambda: json.loads(fleet("status", "--json", "-c", config).stdout)["shards"][2]["state"] == "DONE",
                 120, what="b's slot DONE")
        assert manifest_counts(str(tmp_path / "remote" / "out-b")) == {}


def test_a_host_back_after_the_run_ended_is_told_and_repair_leaves_each_row_once(tmp_path, dense_model):
    """The partition: b cut off with its worker left running; its rows go to a, which finishes the
    run; b's worker finishes the same rows meanwhile. b answers only after the run has ended:
    `fleet verify` tells it where its rows went, refuses to print a training command that would
    count them twice, `--repair` removes b's copies, and verify then passes with one command. (400
    rows, b cut off 10 rows into its 200: it was 800 and 20, a minute more of CI for nothing more.)"""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 400, vocab_size=500, mean_tokens=30, seed=7)
    with two_hosts(tmp_path) as (servers, procs):
        config = hosts_toml(tmp_path, servers, model=dense_model, data=data, gpus={"a": [0], "b": [0]},
                            output=str(tmp_path / "remote" / "out-{host}"), supervise=LOST_AFTER)
        up, lines = up_headless(config)
        try:
            wait_for(lambda: len(manifest_counts(str(tmp_path / "remote" / "out-b"))) >= 10, 240, what="b writing")
            cut(procs["b"])                                   # b's worker runs on, cut off
            assert up.wait(400) == 0, "\n".join(lines)
        finally:
            if up.poll() is None:
                up.kill()
        assert manifest_counts(str(tmp_path / "remote" / "out-a")) == {i: 1 for i in range(400)}
        wait_for(lambda: any(e["event"] == "done" for e in events(tmp_path, "b", 1)), 240, what="b's own worker done")
        assert len(manifest_counts(str(tmp_path / "remote" / "out-b"))) == 200
        procs["b"] = serve(servers["b"])                      # b answers, after the run
        v = fleet("verify", "-c", config)
        assert v.returncode == 1, v.stdout + v.stderr
        assert "b: back; its rows 200–400 went to a while it was lost" in v.stdout, v.stdout
        assert "moved to a while this host was lost" in v.stdout
        assert "train (" not in v.stdout and "fleet verify --repair" in v.stdout, v.stdout
        rep = fleet("verify", "--repair", "-c", config)
        assert "copies of rows another host holds now" in rep.stdout, rep.stdout + rep.stderr
        v = fleet("verify", "-c", config)
        assert v.returncode == 0 and "400 written" in v.stdout and "verify: OK" in v.stdout, v.stdout + v.stderr
        assert len(re.findall(r"^train \(", v.stdout, re.M)) == 1, v.stdout
        assert manifest_counts(str(tmp_path / "remote" / "out-b")) == {}


# --- a supervisor on another machine ------------------------------------------------------------

def test_a_client_joins_a_supervisor_on_another_machine_over_ssh(tmp_path, sshd):
    """`fleet serve` where the run should be supervised from (here: the machine behind the test's
    sshd, whose [[hosts]] entry names it), and `--at` from the laptop: status, logs and the headless
    view through SSH, then `down`."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"0": [[["progress", 3, 10], ["hang"]]]}))
    name = f"remote-{os.getpid()}-{int(time.time() * 1000) % 10**8}"        # found by name over there
    config = hosts_toml(tmp_path, {"box": sshd}, model=None, data=None, gpus={"box": [0]}, run=name, job=f"""[job]
command = "{{python}} {SCRIPTED_JOB} {script} {{shard}}"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"
""")
    env = {k: v for k, v in os.environ.items() if k != "FLEET_STATE_DIR"}   # its default folder, as ssh finds it
    head = subprocess.Popen([sys.executable, "-m", "fleet", "serve", "-c", config], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "w"))
    try:
        wait_for(lambda: "RUNNING" in fleet("status", "--at", "box", "-c", config).stdout, 120,
                 what="the remote supervisor's shard running")
        st = fleet("status", "--json", "--at", "box", "-c", config)
        snap = json.loads(st.stdout)
        assert st.returncode == 0 and snap["supervisor"].startswith(f"pid {head.pid} "), st.stdout + st.stderr
        logs = fleet("logs", "0", "--at", "box", "-c", config)
        assert logs.returncode == 0 and "processed 3/10" in logs.stdout, logs.stdout + logs.stderr
        down = fleet("down", "--yes", "--at", "box", "-c", config)
        assert down.returncode == 0 and "box: stopped 1 shard(s) (0)" in down.stdout, down.stdout + down.stderr
        assert head.wait(60) == 0                                           # stopped: it goes by itself
        gone = fleet("status", "--at", "box", "-c", config)
        assert gone.returncode == 1 and f"no supervisor of run {name} runs on" in gone.stderr, gone.stderr
    finally:
        if head.poll() is None:
            head.send_signal(signal.SIGTERM)
            head.wait(30)
        fleet("down", "--yes", "-c", config)


def test_a_host_taken_out_of_fleet_toml_mid_run_is_said_and_its_rows_go_to_the_others(tmp_path):
    """b is taken out of fleet.toml while its rows are not done (its box gone): `fleet up` says what
    becomes of it instead of refusing the run, b's shard is UNKNOWN, and b's unfinished rows are done
    by a; every row is done."""
    from tests.fleet.conftest import lose_host
    with two_hosts(tmp_path) as (servers, procs):
        config = hosts_toml(tmp_path, servers, model=None, data=None, gpus={"a": [0], "b": [0]},
                            output=str(tmp_path / "remote" / "out-{host}"), job=rows_job(300, 0.05),
                            supervise='host_lost_after = "3s"')
        up, lines = up_headless(config)
        try:
            wait_for(lambda: len(rows_done(tmp_path / "remote" / "out-b")) > 10, 120, what="b writing")
            up.kill()
            up.wait(10)
            stop_supervisor(config)
            lose_host(tmp_path, procs, "b", (1,))
        finally:
            if up.poll() is None:
                up.kill()
        text = open(config).read()
        head, _, rest = text.partition('[[hosts]]\nname = "b"')
        open(config, "w").write(head.rstrip() + "\n" + rest.partition("\n\n")[2] if "\n\n" in rest else head)
        assert 'name = "b"' not in open(config).read() and 'name = "a"' in open(config).read()
        r = fleet("up", "--headless", "-c", config, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "b: no longer in fleet.toml, but the run's plan has shards 1 there: its rows go to the other " \
               "hosts now" in r.stderr, r.stderr
        assert re.search(r"rows [\d,]+–300 of b \(no longer in fleet.toml\) → a", r.stderr), r.stderr
        done = rows_done(tmp_path / "remote" / "out-a") + rows_done(tmp_path / "remote" / "out-b")
        assert sorted(set(done)) == list(range(300))
        snap = json.loads(fleet("status", "--json", "-c", config).stdout)
        assert snap["totals"]["finished"] and snap["shards"][1]["state"] == "UNKNOWN"
        assert "no longer in fleet.toml" in snap["shards"][1]["reason"]
