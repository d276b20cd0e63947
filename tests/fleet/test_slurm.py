"""Slurm as the launcher, against a real Slurm (tests/slurm_cluster.py: munged, slurmctld and slurmd
started by the fixture, one node on 127.0.0.1 with two CPU-only slots): the tiny model as a 2-task
array to DONE through SSH to the login node, scancel / node failure / preemption seen as failures
with Slurm's reason and restarted, a task queued behind a full node shown QUEUED with Slurm's
reason, `x` / `r` / `fleet down`, and `fleet logs` reading the task's log."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import sys
import time

import jsonschema
import pytest

from fleet.state import State
from tests.conftest import wait_for
from tests.fleet.conftest import fleet, fleet_popen
from tests.fleet.test_records import deployed, due_later
from tests.fleet.test_records import until as until_true
from tests.fleet.test_ssh_e2e import Output
from tests.sshd_server import start_sshd
from worker import protocol

pytestmark = pytest.mark.slurm

ROWS_JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "rows_job.py")
SCRIPTED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "scripted_job.py")


def run_and_job(tmp_path, model: str | None, data: str | None, script: dict | None) -> tuple[str, str]:
    """[run]'s model lines (the built-in worker) and a [job] section running tests/jobs/scripted_job.py
    on `script` (written beside fleet.toml), for an engine's fleet.toml; "" for what is not asked."""
    run, job = "", ""
    if model:
        run = f'model = {json.dumps(model)}\ndata = {json.dumps(data)}\nlayers = "speculators"\n'
    if script is not None:
        (tmp_path / "script.json").write_text(json.dumps(script))
        job = f"""
[job]
command = "{{python}} {SCRIPTED} {tmp_path / 'script.json'} {{shard}}"
done = "ALL DONE"
fail = "FAIL|ERROR"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"
"""
    return run, job


def slurm_toml(tmp_path, *, script: dict | None = None, model: str | None = None, data: str | None = None,
               shards: int = 2, login: str = "local", ssh=None, expected: str = "", job: str = "") -> str:
    """A [slurm] run whose root and output are under tmp_path/shared (the "shared filesystem");
    `job`: a [job] section of the test's own."""
    shared = tmp_path / "shared"
    run, scripted = run_and_job(tmp_path, model, data, script)
    job = scripted or job
    login_lines = ""
    if ssh is not None:
        login_lines = (f"port = {ssh.port}\nidentity_file = {json.dumps(ssh.client_key)}\n"
                       f"known_hosts = {json.dumps(ssh.known_hosts)}\n")
    text = f"""
[run]
name = "t"
{run}output = {json.dumps(str(shared / 'out'))}
max_tokens_per_batch = 512
device = "cpu"
env = {{ OMP_NUM_THREADS = "1" }}

{expected}

[supervise]
stall_timeout = "120s"
backoff_base = "0.5s"
backoff_max = "2s"
{job}
[slurm]
login = "{login}"
{login_lines}partition = "debug"
time = "00:30:00"
gpus_per_task = 0
shards = {shards}
root = {json.dumps(str(shared / 'fleet'))}
python = {json.dumps(sys.executable)}
poll_interval = "1s"
"""
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return str(path)


def events(tmp_path, shard: int) -> list[protocol.Record]:
    return protocol.read_events(str(tmp_path / "shared" / "fleet" / "t" / "shards" / str(shard) / "events.jsonl"))


def of(kind, evs: list) -> list:
    return [e for e in evs if isinstance(e, kind)]


def progress(tmp_path, shard: int, launch: int) -> int:
    return max([e.done for e in of(protocol.Progress, events(tmp_path, shard)) if e.launch == launch], default=0)


def status(config: str) -> dict:
    r = fleet("status", "--json", "-c", config)
    return {**json.loads(r.stdout), "rc": r.returncode}


def out_has(text: str, *parts: str) -> bool:
    """Some line of `text` holds every part, in order."""
    return any(all(p in line for p in parts) and
               [line.index(p) for p in parts] == sorted(line.index(p) for p in parts)
               for line in text.splitlines())


def manifest(tmp_path) -> list[int]:
    return [json.loads(l)["index"] for p in glob.glob(str(tmp_path / "shared" / "out" / "manifest" / "*"))
            for l in open(p) if l.strip()]


def test_the_tiny_model_runs_as_a_two_task_array_to_done_through_ssh_to_the_login_node(
        tmp_path, slurm, dense_model, token_data):
    """fleet reaches the login node over SSH (Slurm's commands find the cluster there, not here),
    deploys the worker to the shared root, submits one array, and follows the records the tasks
    write on the shared filesystem."""
    login, sshd = start_sshd(str(tmp_path / "login"), extra=f"SetEnv SLURM_CONF={slurm.conf}")
    try:
        config = slurm_toml(tmp_path, model=dense_model, data=token_data, login="root@127.0.0.1", ssh=login,
                            expected="[expected]\nsamples_per_s_per_gpu = 5")
        r = fleet("up", "--headless", "-c", config, env={k: v for k, v in os.environ.items() if k != "SLURM_CONF"})
        assert r.returncode == 0, r.stdout + r.stderr
        assert "shards 0,1: launch (manual): submitted: as job" in r.stderr
        for k in (0, 1):
            assert f"shard {k} localhost:0 RUNNING -> DONE 30/30" in r.stdout, r.stdout
        # The record: the launch at submission, Slurm's job, then the task's own `started` on its node.
        jobs = []
        for k in (0, 1):
            evs = events(tmp_path, k)
            [launch], [sub] = of(protocol.Launch, evs), of(protocol.Submitted, evs)
            started = [e for e in of(protocol.Started, evs) if e.node]
            assert launch.launcher == "slurm" and launch.by == "manual" and sub.job.endswith(f"_{k}")
            assert (started[0].node, started[0].job) == ("localhost", sub.job)
            assert of(protocol.Exited, evs)[-1].code == 0
            jobs.append(sub.job)
        assert jobs[0].split("_")[0] == jobs[1].split("_")[0]             # one array
        # What fleet.toml's [slurm] asked of sbatch, as Slurm itself reports the job.
        shown = slurm.run("scontrol", "show", "job", jobs[0]).stdout
        for part in ("JobName=fleet-t", "Partition=debug", "TimeLimit=00:30:00", "JobState=COMPLETED",
                     "Requeue=0", f"StdOut={tmp_path}/shared/fleet/t/shards/0/log"):
            assert part in shown, shown
        st = status(config)
        schema = json.loads(fleet("status", "--json-schema").stdout)
        jsonschema.validate({k: v for k, v in st.items() if k != "rc"}, schema)
        assert st["rc"] == 0
        assert [(s["id"], s["host"], s["state"], s["task"]["job"], s["task"]["node"]) for s in st["shards"]] == \
            [(0, "localhost", "DONE", jobs[0], "localhost"), (1, "localhost", "DONE", jobs[1], "localhost")]
        assert [(h["name"], h["role"]) for h in st["hosts"]] == [("slurm", "login"), ("localhost", "node")]
        assert st["hosts"][0]["address"] == "root@127.0.0.1" and st["totals"]["done"] == 60
        logs = fleet("logs", "1", "-c", config)
        assert logs.returncode == 0 and "[shard 1] done done=30" in logs.stdout, logs.stdout + logs.stderr
        v = fleet("verify", "-c", config)
        assert v.returncode == 0 and "60 written" in v.stdout, v.stdout
    finally:
        sshd.terminate()
        sshd.wait(10)


def test_a_job_taking_its_rows_runs_each_tasks_planned_range_once(tmp_path, slurm):
    """Under Slurm a [job] taking {start}/{end} keeps each task's planned rows (rows do not move
    between tasks: README): each task runs the command once over its range, on the node Slurm
    gave it, and the run ends DONE with every row written once."""
    out = tmp_path / "shared" / "out"
    job = f"""
[job]
command = "{{python}} {ROWS_JOB} {out} {{start}} {{end}} {{shard}} --sleep 0.01"
done = "ALL DONE"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"
rows = 200
"""
    config = slurm_toml(tmp_path, job=job)
    r = fleet("up", "--headless", "-c", config, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [(int(i), int(k)) for i, k, _ in (line.split() for line in (out / "rows.txt").read_text().splitlines())]
    assert sorted(i for i, _ in rows) == list(range(200))
    assert all((k == 0) == (i < 100) for i, k in rows)                  # each task its own range
    for k, planned in ((0, (0, 100)), (1, (100, 200))):
        evs = events(tmp_path, k)
        assert [(e.start, e.stop, e.how) for e in of(protocol.Leased, evs)] == [(*planned, "plan")]
        assert of(protocol.Started, evs)[0].node == "localhost"
    assert [s["state"] for s in status(config)["shards"]] == ["DONE", "DONE"]


def test_scancel_of_a_task_is_a_failure_with_slurms_reason_and_the_shard_resumes_to_done(
        tmp_path, slurm, dense_model):
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "rows.jsonl"), 3000, vocab_size=500, mean_tokens=50, seed=11)
    config = slurm_toml(tmp_path, model=dense_model, data=data)
    proc = fleet_popen("up", "--headless", "-c", config)
    out = Output(proc)
    try:
        wait_for(lambda: 0 < progress(tmp_path, 0, 1) < 1500, 240, interval=0.05, what="shard 0 extracting")
        [first] = of(protocol.Submitted, events(tmp_path, 0))
        slurm.run("scancel", first.job)                                   # not fleet's doing
        assert proc.wait(600) == 0, out.text()
    finally:
        if proc.poll() is None:
            proc.kill()
    out.thread.join(5)
    assert out.has("shard 0", "-> BACKOFF", "Slurm CANCELLED on localhost: cancelled outside fleet (by an "
                                            "admin, or the engine's own command); restart in 0.5s"), out.text()
    assert out.has("shard 0", "-> DONE 1500/1500") and out.has("shard 1", "-> DONE 1500/1500")
    evs = events(tmp_path, 0)
    assert [e.by for e in of(protocol.Launch, evs)] == ["manual", "auto"]
    subs = of(protocol.Submitted, evs)
    assert len(subs) == 2 and subs[1].job != first.job and subs[1].job.endswith("_0")
    assert [(e.launch, e.state) for e in of(protocol.TaskEnded, evs)] == [(1, "CANCELLED")]
    assert sorted(manifest(tmp_path)) == list(range(3000))                # resumed: nothing twice
    st = status(config)
    s0 = st["shards"][0]
    assert (s0["state"], s0["restarts"], s0["failures"]) == ("DONE", 1, 1)
    assert s0["last_failure"].startswith("Slurm CANCELLED on localhost")
    assert st["shards"][1]["restarts"] == 0
    # The task's log on the shared filesystem holds Slurm's own line about the cancellation.
    logs = fleet("logs", "0", "-n", "100000", "-c", config)
    assert "CANCELLED AT" in logs.stdout and "[shard 0] done done=1500" in logs.stdout


def test_a_task_queued_behind_a_full_node_is_queued_with_slurms_reason_and_fleet_down_cancels_it(tmp_path, slurm):
    blocker = slurm.run("sbatch", "--parsable", "-J", "blocker", "-o", "/dev/null", "--cpus-per-task=2",
                        "--wrap", "sleep 600").stdout.strip()
    wait_for(lambda: slurm.jobs().get(blocker, ("",))[0] == "RUNNING", 30, what="the blocker running")
    script = {k: [[["progress", 1, 2], ["progress", 2, 2], ["print", "ALL DONE"], ["exit", 0]]] for k in ("0", "1")}
    config = slurm_toml(tmp_path, script=script, expected="[expected]\nsamples_per_s_per_gpu = 5")
    proc = fleet_popen("up", "--headless", "-c", config)
    out = Output(proc)
    try:
        def queued():
            st = status(config)
            return st if [s["state"] for s in st["shards"]] == ["QUEUED", "QUEUED"] and \
                all(s["reason"] == "Resources" for s in st["shards"]) else None
        st = wait_for(queued, 60, interval=0.5, what="both shards QUEUED (Resources)")
        for k, s in enumerate(st["shards"]):
            assert s["host"] == "slurm" and s["faulty"] is False and s["alive"] is True
            assert s["task"]["state"] == "PENDING" and s["task"]["reason"] == "Resources"
            assert slurm.jobs()[s["task"]["job"]] == ("PENDING", "Resources")   # Slurm says the same
        assert st["rc"] == 0                                              # waiting is not a fault
        assert st["totals"]["expected_per_s"] is None                     # nor expected to produce
        # Slurm not answering is said, and concludes nothing: the tasks are not taken for ended.
        dead = slurm.unreachable_conf(str(tmp_path / "dead.conf"))
        blind = fleet("status", "--json", "--from-hosts", "-c", config, env={**os.environ, "SLURM_CONF": dead})
        st = json.loads(blind.stdout)
        assert st["hosts"][0]["error"].startswith("Slurm: squeue failed:"), st["hosts"][0]
        assert [s["state"] for s in st["shards"]] == ["QUEUED", "QUEUED"] and blind.returncode == 0
        assert not any(of(protocol.Exited, events(tmp_path, k)) for k in (0, 1))
        down = fleet("down", "--yes", "-c", config)
        assert down.returncode == 0 and "slurm: stopped 2 shard(s) (0, 1)" in down.stdout, down.stdout + down.stderr
        assert proc.wait(60) == 1                                         # STOPPED: up exits 1
    finally:
        if proc.poll() is None:
            proc.kill()
    out.thread.join(5)
    assert out.has("shard 0", "QUEUED -> STOPPED") and out.has("shard 1", "QUEUED -> STOPPED"), out.text()
    assert slurm.live_jobs() == [blocker]                                  # the array is gone
    for k in (0, 1):
        evs = events(tmp_path, k)
        assert of(protocol.StopRequested, evs)[0].why == "run" and not of(protocol.Started, evs)
        assert [e.state for e in of(protocol.TaskEnded, evs)] == ["CANCELLED"]
        assert of(protocol.Exited, evs)[0].vanished                         # it never ran to record one
    st = status(config)
    assert [(s["state"], s["reason"]) for s in st["shards"]] == [("STOPPED", "stopped")] * 2
    # The node free again, `fleet up` launches the stopped shards afresh and they finish.
    slurm.run("scancel", blocker)
    again = fleet("up", "--headless", "-c", config)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [s["state"] for s in status(config)["shards"]] == ["DONE", "DONE"]
    assert [e.by for e in of(protocol.Launch, events(tmp_path, 0))] == ["manual", "manual"]


def test_node_failure_and_preemption_are_failures_with_slurms_reason_restarted_under_the_policy(tmp_path, slurm):
    go = tmp_path / "go"
    script = {k: [[["progress", 1, 3], ["hang"]], [["progress", 2, 3], ["hang"]],
                  [["progress", 3, 3], ["wait", str(go)], ["print", "ALL DONE"], ["exit", 0]]] for k in ("0", "1")}
    config = slurm_toml(tmp_path, script=script)
    proc = fleet_popen("up", "--headless", "-c", config)
    out = Output(proc)
    try:
        wait_for(lambda: all(progress(tmp_path, k, 1) == 1 for k in (0, 1)), 60, what="launch 1 running")
        slurm.run("scontrol", "update", "NodeName=localhost", "State=DOWN", "Reason=fleet-test")
        # Relaunched at once under the policy, and queued while the node is down, with Slurm's reason.
        # (Slurm's pending reason names the node DOWN once its scheduler has looked at the job
        # again: on a loaded machine, a minute or more.)
        seen: list[dict] = []
        def queued():
            seen.append(status(config))
            return seen[-1] if all(x["state"] == "QUEUED" and x["restarts"] == 1 and "DOWN" in (x["reason"] or "")
                                   for x in seen[-1]["shards"]) else None
        try:
            st = wait_for(queued, 180, interval=0.5, what="both resubmitted and queued, the node down")
        except AssertionError as e:
            raise AssertionError(f"{e}; last seen: {[(x['state'], x['restarts'], x['reason']) for x in seen[-1]['shards']]}")
        assert all(s["last_failure"] == "Slurm NODE_FAIL on localhost: its node failed (NodeDown)"
                   for s in st["shards"]), st["shards"]
        slurm.run("scontrol", "update", "NodeName=localhost", "State=RESUME")
        wait_for(lambda: all(progress(tmp_path, k, 2) == 2 for k in (0, 1)), 60, what="launch 2 running")
        urgent = slurm.run("sbatch", "--parsable", "-p", "urgent", "-J", "urgent", "-o", "/dev/null", "--cpus-per-task=2",
                           "--wrap", "sleep 2").stdout.strip()
        wait_for(lambda: all(len(of(protocol.Launch, events(tmp_path, k))) == 3 for k in (0, 1)), 60,
                 what="relaunched after the preemption")
        go.touch()
        assert proc.wait(120) == 0, out.text()
    finally:
        if proc.poll() is None:
            proc.kill()
    out.thread.join(5)
    for k in (0, 1):
        assert out.has(f"shard {k}", "-> BACKOFF", "Slurm NODE_FAIL on localhost: its node failed (NodeDown)")
        assert out.has(f"shard {k}", "-> BACKOFF", "Slurm PREEMPTED on localhost: preempted by a job of "
                                                   "higher priority"), out.text()
        evs = events(tmp_path, k)
        assert [e.by for e in of(protocol.Launch, evs)] == ["manual", "auto", "auto"]
        assert [e.state for e in of(protocol.TaskEnded, evs)] == ["NODE_FAIL", "PREEMPTED"]
    assert slurm.jobs()[urgent][0] == "COMPLETED"
    st = status(config)
    assert [(s["state"], s["restarts"], s["failures"]) for s in st["shards"]] == [("DONE", 2, 2)] * 2


async def test_the_tuis_keys_k_cancels_a_task_for_good_r_resubmits_its_index_and_d_cancels_the_array(
        tmp_path, slurm):
    """The live TUI on a Slurm run, keys pressed as a user presses them: its panes show the node,
    the log of the task on the shared filesystem; `x`, `r`, `D` mean what they mean on SSH hosts."""
    from fleet.tui.panes.log import LogView
    from fleet.tui.panes.shards import ShardTable
    from tests.fleet.test_tui import cell, supervised_app, until

    script = {"0": [[["progress", 1, 3], ["hang"]], [["progress", 2, 3], ["hang"]]], "1": [[["progress", 1, 3], ["hang"]]]}
    sup = await deployed(slurm_toml(tmp_path, script=script))
    app = supervised_app(sup)
    async with app.run_test(size=(170, 48)) as pilot:
        shards = app.main.query_one(ShardTable)
        await until(pilot, lambda: app.snap and [s.done for s in app.snap.shards] == [1, 1], what="both running")
        await until(pilot, lambda: [cell(shards, k, "state") for k in "01"] == ["▶ RUNNING"] * 2,
                    what="both drawn RUNNING")
        assert cell(shards, "0", "where") == "localhost:0"                   # the node it runs on
        gpus_line = str(app.main.query_one("#gpus-title").render())
        assert "slurm: no GPU telemetry" in gpus_line, gpus_line             # what the task reported
        await until(pilot, lambda: any("processed 1/3" in text for text, _, _ in app.main.query_one("#log", LogView).lines),
                    what="the task's log")
        shards.move_to_key("1")
        await pilot.press("x", "y")                                          # x: cancel that task
        await until(pilot, lambda: cell(shards, "1", "state").endswith("STOPPED"), what="shard 1 STOPPED")
        verdict, action = due_later(sup, 1)                                  # long past the backoff
        assert (verdict.state, action) == (State.STOPPED, None)
        assert cell(shards, "1", "state").endswith("STOPPED") and app.snap.shards[1].restarts == 0
        shards.move_to_key("0")
        await pilot.press("r", "y")                                          # r: resubmit its index
        await until(pilot, lambda: app.snap.shards[0].done == 2, what="shard 0 resubmitted and running")
        assert app.snap.shards[0].restarts == 1
        subs = of(protocol.Submitted, events(tmp_path, 0))
        assert len(subs) == 2 and subs[1].job.split("_")[0] != subs[0].job.split("_")[0]
        assert slurm.run("scontrol", "show", "job", subs[1].job).stdout.count("ArrayTaskId=") == 1  # index 0 alone
        await pilot.press("D", "D")                                          # D (D again): cancel the run
        await until(pilot, lambda: cell(shards, "0", "state").endswith("STOPPED"), what="shard 0 STOPPED")
        await pilot.press("q")
    assert app.return_value.startswith("fleet: nothing of run t is running (2 STOPPED)."), app.return_value
    assert slurm.live_jobs() == []
    evs0, evs1 = events(tmp_path, 0), events(tmp_path, 1)
    assert [(e.why, e.launch) for e in of(protocol.StopRequested, evs0)] == [("restart", 1), ("run", 2)]
    assert [e.by for e in of(protocol.Launch, evs0)] == ["manual", "manual"]
    assert [(e.why, e.launch) for e in of(protocol.StopRequested, evs1)] == [("user", 1), ("run", 1)]   # D records the run stop for every shard
    assert len(of(protocol.Launch, evs1)) == 1                               # never restarted
    assert [e.state for e in of(protocol.TaskEnded, evs1)] == ["CANCELLED"]


async def test_a_slow_slurm_controller_never_silences_the_login_node(tmp_path, slurm, monkeypatch):
    """squeue answering after 7 s (busy clusters do): the agent asks in a thread of its own and
    keeps beating, so the login node is never taken for unreachable (5 s of silence), and the run
    finishes all the same."""
    from tests.slurm_cluster import _which
    slow = tmp_path / "slow-bin"
    slow.mkdir()
    answered = tmp_path / "squeue-answered"                 # a line per slow answer
    (slow / "squeue").write_text(f"#!/bin/sh\nsleep 7\necho >> {answered}\nexec {_which('squeue')} \"$@\"\n")
    (slow / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{slow}:{os.environ['PATH']}")
    script = {k: [[["progress", 1, 2], ["sleep", 1], ["progress", 2, 2], ["print", "ALL DONE"], ["exit", 0]]]
              for k in ("0", "1")}
    logs: list[str] = []
    sup = await deployed(slurm_toml(tmp_path, script=script), logs)
    seen = []
    sup.on_change = lambda: seen.append(sup.links["slurm"].host.reachable)
    await sup.start()
    try:
        await sup.launch_all()
        deadline = time.monotonic() + 120
        while not (sup.replayed and not sup.acting and sup.snapshot().totals.settled):
            assert time.monotonic() < deadline, logs
            await asyncio.sleep(0.2)
        assert [s.state.value for s in sup.snapshot().shards] == ["DONE", "DONE"]
        # Slurm's word on the finished tasks is asked for too (slowly): they were COMPLETED.
        count = lambda: len(answered.read_text().splitlines()) if answered.exists() else 0
        before = count()
        await until_true(lambda: count() > before, timeout=60, what="a slow squeue answered after the finish")
        assert sup.links["slurm"].host.reachable is True
    finally:
        await sup.close()
    assert not [m for m in logs if "unreachable" in m], logs
    assert False not in seen


def test_what_sbatch_refuses_is_one_line_quoting_slurm_and_the_policy_gives_up(tmp_path, slurm):
    """A submission Slurm refuses (more memory than the node has): each shard's attempt failed with
    sbatch's own error line, restarted under the policy, then FATAL quoting it."""
    script = {k: [[["print", "ALL DONE"], ["exit", 0]]] for k in ("0", "1")}
    config = slurm_toml(tmp_path, script=script)
    text = open(config).read().replace('gpus_per_task = 0\n', 'gpus_per_task = 0\nsbatch_args = ["--mem=999999"]\n')
    open(config, "w").write(text.replace('backoff_max = "2s"', 'backoff_max = "2s"\nmax_restarts = 1'))
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode == 1, r.stdout + r.stderr
    refusal = "sbatch refused: sbatch: error: Batch job submission failed: Requested node configuration is not available"
    assert f"shards 0,1: launch (manual): refused: {refusal}" in r.stderr, r.stderr
    for k in (0, 1):
        # (from PENDING, or from QUEUED when a frame saw the submission under way)
        assert out_has(r.stdout, f"shard {k} slurm:0", f"-> BACKOFF 0/0 ({refusal}; restart in 0.5s)"), r.stdout
        assert out_has(r.stdout, f"shard {k} slurm:0", f"-> FATAL 0/0 (gave up after 1 restart(s); last: {refusal})")
        evs = events(tmp_path, k)
        assert [e.by for e in of(protocol.Launch, evs)] == ["manual", "auto"]      # one restart, no more
        assert [e.reason for e in of(protocol.Failed, evs)] == [refusal] * 2 and not of(protocol.Submitted, evs)
    assert slurm.live_jobs() == []


def test_a_partition_slurm_does_not_know_is_refused_by_preflight(tmp_path, slurm):
    config = slurm_toml(tmp_path, script={"0": [], "1": []})
    text = open(config).read().replace('partition = "debug"', 'partition = "gpu-nosuch"')
    open(config, "w").write(text)
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode != 0
    assert "partition gpu-nosuch unknown to Slurm" in r.stdout + r.stderr, r.stdout + r.stderr
    assert not os.path.exists(tmp_path / "shared" / "fleet" / "t" / "shards" / "0" / "events.jsonl")
    assert slurm.live_jobs() == []


def test_an_unreachable_login_node_is_one_line_naming_it(tmp_path):
    """No Slurm needed: nothing listens where the login node should be."""
    import subprocess
    from tests.sshd_server import free_port

    class Nowhere:
        port = free_port()
        client_key = str(tmp_path / "id")
        known_hosts = str(tmp_path / "known_hosts")
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", Nowhere.client_key], check=True)
    (tmp_path / "known_hosts").write_text("")
    config = slurm_toml(tmp_path, script={"0": [], "1": []}, login="alice@127.0.0.1", ssh=Nowhere)
    where = f"slurm (alice@127.0.0.1:{Nowhere.port}): "
    for argv in (("up", "--headless"), ("status",), ("down", "--yes"), ("logs", "0"), ("restart", "1")):
        r = fleet(*argv, "-c", config)
        assert r.returncode == 3, (argv, r.stdout, r.stderr)
        said = [l for l in (r.stdout + r.stderr).splitlines() if where in l]
        assert said and f"{where}connection refused (is sshd listening on port {Nowhere.port}?)" in said[-1], \
            (argv, r.stdout, r.stderr)
    st = json.loads(fleet("status", "--json", "-c", config).stdout)
    assert (st["hosts"][0]["reachable"], st["hosts"][0]["role"]) == (False, "login")
    assert st["hosts"][0]["error"].startswith(where)
