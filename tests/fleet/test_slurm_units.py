"""Slurm as the launcher, the pure parts: the [slurm] section, what squeue/sacct print and how it is
read, the submission, the fold and the judge of Slurm attempts (including the judge's invariants over
random Slurm histories), the snapshot's nodes and the plan. The real cluster is in test_slurm.py."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.config import ExpectedSpec, load_config
from fleet.engine.slurm import SlurmLauncher, sbatch_options
from fleet.engine.tasks import task_nodes, task_status
from worker.engine.tasks import own_gpus
from fleet.judge import ENGINE_WORD_WAIT_S, Action, Policy, judge
from fleet.plan import make_plan, plan_differences
from fleet.record import fold
from fleet.snapshot import ShardView, build_snapshot
from fleet.hosts import Host
from fleet.state import SETTLED, State
from tests.fleet.test_config import error_of, write
from tests.fleet.test_judge import World, assert_within_restart_budget
from worker import protocol as p
from worker.engine import slurm

RUN = """\
[run]
name = "qwen-hs"
model = "/shared/models/m"
data = "/shared/data/d.jsonl"
output = "/shared/hs"
"""
SLURM = """
[slurm]
login = "alice@login.cluster.example"
partition = "gpu"
account = "spec"
time = "12:00:00"
gpus_per_task = 1
max_parallel = 64
sbatch_args = ["--qos=normal"]
root = "/shared/fleet"
python = "/shared/venv/bin/python"
shards = 128
"""


# --- fleet.toml ---------------------------------------------------------------------------------

def test_the_slurm_section_as_the_issue_writes_it(tmp_path):
    c = load_config(write(tmp_path, RUN + SLURM))
    [login] = c.hosts
    # port left out: the login's ~/.ssh/config entry, else 22 (fleet.transport.resolve)
    assert (login.name, login.address, login.user, login.port) == ("slurm", "login.cluster.example", "alice", None)
    assert c.run_dir(login) == "/shared/fleet/qwen-hs" and c.python(login) == "/shared/venv/bin/python"
    assert c.job_name == "fleet-qwen-hs" and c.slurm.poll_interval == 5.0
    assert sbatch_options(c.slurm) == ["--partition=gpu", "--account=spec", "--time=12:00:00", "--gres=gpu:1",
                                       "--qos=normal"]
    local = load_config(write(tmp_path, RUN + '[slurm]\nshards = 2\ngpus_per_task = 0\npoll_interval = "2s"\n'))
    assert local.hosts[0].is_local and sbatch_options(local.slurm) == [] and local.slurm.poll_interval == 2.0


def test_slurm_and_hosts_are_alternatives_and_errors_name_the_line(tmp_path):
    hosts = '\n[[hosts]]\nname = "box1"\naddress = "203.0.113.7"\n'
    path = write(tmp_path, RUN + SLURM + hosts)
    assert error_of(tmp_path, RUN + SLURM + hosts) == (
        f"{path}:7: [slurm] and [[hosts]] are alternatives: an engine ([slurm], [ray]) places the shards on its nodes, "
        f"[[hosts]] are SSH boxes fleet launches on; keep one of them")
    assert "hosts: required key missing" in error_of(tmp_path, RUN)
    cases = [
        ('time = "12:00:00"', 'time = "12h"', 11, "slurm.time: not a Slurm time limit: '12h'"),
        ('sbatch_args = ["--qos=normal"]', 'sbatch_args = ["--array=0-9"]', 14,
         "slurm.sbatch_args: '--array=0-9': fleet sets --array itself"),
        ('sbatch_args = ["--qos=normal"]', 'sbatch_args = ["-o", "x.log"]', 14, "fleet sets -o itself"),
        ('sbatch_args = ["--qos=normal"]', 'sbatch_args = ["qos=normal"]', 14, "give each option as one item"),
        ('partition = "gpu"', 'partitoin = "gpu"', 9, "unknown key 'partitoin' in [slurm]; did you mean 'partition'?"),
        ('login = "alice@login.cluster.example"', 'login = "-oProxyCommand=x"', 8, "slurm.login:"),
        ('shards = 128', 'shards = 0', 17, "slurm.shards: Input should be greater than 0"),
        ('shards = 128', '', 7, "slurm.shards: required key missing"),
        ('gpus_per_task = 1', 'gpus_per_task = -1', 12, "slurm.gpus_per_task"),
    ]
    for old, new, line, expected in cases:
        text = RUN + SLURM.replace(old, new)
        msg = error_of(tmp_path, text)
        assert msg.startswith(f"{path}:{line}: ") and expected in msg, (new, msg)


def test_a_submission_lets_slurm_choose_the_gpus_and_carries_each_shards_command(tmp_path):
    c = load_config(write(tmp_path, RUN + SLURM))
    places = SlurmLauncher(c).place({})
    assert len(places) == 128 and {(x.host, x.gpu) for x in places} == {("slurm", 0)}
    sub = SlurmLauncher(c).submission(c.hosts[0], places[3:5], 128, "auto")
    assert (sub["job_name"], sub["by"], sub["max_parallel"]) == ("fleet-qwen-hs", "auto", 64)
    assert sub["pythonpath"].startswith("/shared/fleet/qwen-hs/code/") and sub["python"] == "/shared/venv/bin/python"
    assert sorted(sub["tasks"]) == ["3", "4"]
    task = sub["tasks"]["4"]
    assert "CUDA_VISIBLE_DEVICES" not in task["env"]                      # Slurm sets it for the task
    argv = task["argv"]
    assert argv[argv.index("--shard-index") + 1] == "4" and argv[argv.index("--num-shards") + 1] == "128"
    assert argv[argv.index("--plan") + 1] == "/shared/fleet/qwen-hs/plan.json"


def test_the_plan_of_a_slurm_run_is_its_shard_count():
    class C:                                                                # what make_plan reads
        pass
    base = {"version": 1, "run": "r", "num_shards": 2, "launcher": "slurm",
            "shards": [{"id": k, "host": "slurm", "gpu": 0} for k in range(2)], "spec": {}, "identity": {}}
    grown = {**base, "num_shards": 4, "shards": [{"id": k, "host": "slurm", "gpu": 0} for k in range(4)]}
    ssh = {**base, "launcher": None, "shards": [{"id": 0, "host": "box", "gpu": 0}]}
    base, grown, ssh = (p.Plan.from_dict(d) for d in (base, grown, ssh))
    slurm_layout = {"layout_differences": SlurmLauncher.layout_differences}     # as setup passes the engine's
    assert plan_differences(base, grown, **slurm_layout) == ["shards: 2 -> 4"]
    assert plan_differences(base, base, **slurm_layout) == []
    assert plan_differences(ssh, base, **slurm_layout) == ["launcher: ssh hosts -> slurm"]


def test_make_plan_for_slurm(tmp_path):
    c = load_config(write(tmp_path, RUN + SLURM))
    plan = make_plan(c, SlurmLauncher(c).place({}), "slurm", {})
    assert plan.num_shards == 128 and plan.launcher == "slurm" and plan.shards[127] == \
        p.PlanShard(id=127, host="slurm", gpu=0, gpus=[0])


def test_a_shard_of_several_gpus_is_a_task_asking_for_them(tmp_path):
    """[run] gpus_per_shard = 2: each task asks Slurm for 2 GPUs (gpus_per_task follows it) and its
    worker spans the 2 Slurm gives it (Slurm sets CUDA_VISIBLE_DEVICES)."""
    two = RUN.replace('output = "/shared/hs"', 'output = "/shared/hs"\ngpus_per_shard = 2')
    c = load_config(write(tmp_path, two + SLURM.replace("gpus_per_task = 1\n", "")))
    assert "--gres=gpu:2" in sbatch_options(c.slurm, 2)
    [place] = SlurmLauncher(c).place({})[5:6]
    assert (place.shard, place.gpu, place.all_gpus) == (5, 0, (0, 1))
    sub = SlurmLauncher(c).submission(c.hosts[0], [place], 128, "manual")
    assert "--gres=gpu:2" in sub["sbatch"]
    argv = sub["tasks"]["5"]["argv"]
    assert argv[argv.index("--gpus-per-shard") + 1] == "2" and "CUDA_VISIBLE_DEVICES" not in sub["tasks"]["5"]["env"]
    assert make_plan(c, SlurmLauncher(c).place({}), "slurm", {}).shards[5] == p.PlanShard(id=5, host="slurm", gpu=0, gpus=[0, 1])
    path = write(tmp_path, two + SLURM)
    assert error_of(tmp_path, two + SLURM) == (
        f"{path}:13: slurm.gpus_per_task = 1, but [run] gpus_per_shard = 2: each array task runs one shard "
        f"on its own GPUs; leave gpus_per_task out (it follows gpus_per_shard) or make them equal")


# --- what Slurm prints ----------------------------------------------------------------------------

def test_squeue_lines_and_arrays_never_split_out():
    listed = slurm.parse_squeue(
        "7_0|RUNNING|node07|None\n"
        "7_1|PENDING||ReqNodeNotAvail, UnavailableNodes:node[01-02]\n"
        "8_[2-5%2]|PENDING||JobArrayTaskLimit\n"
        "9|CANCELLED||Resources\n"
        "garbage line\n")
    assert listed["7_0"] == slurm.View("7_0", "running", "RUNNING", None, "node07")
    assert listed["7_1"].reason == "ReqNodeNotAvail, UnavailableNodes:node[01-02]" and listed["7_1"].live
    views = slurm.task_views(listed, ["7_0", "8_4", "8_6", "9_1", "10_0"])
    assert views["8_4"] == slurm.View("8_4", "queued", "PENDING", "JobArrayTaskLimit", None)
    assert "8_6" not in views and "10_0" not in views                     # not covered, not listed
    assert views["9_1"].state == "CANCELLED" and views["9_1"].terminal       # a whole queued array cancelled
    acct = slurm.parse_sacct("12_3|CANCELLED by 0|node02|None\n12_4|TIMEOUT|node03|TimeLimit\n")
    assert acct["12_3"] == slurm.View("12_3", "ended", "CANCELLED", None, "node02", "cancelled") and acct["12_4"].reason == "TimeLimit"


def test_array_spec():
    assert slurm.array_spec([0, 1, 2, 3], 64) == "0-3%64"
    assert slurm.array_spec([7, 0, 2, 1, 5, 8], None) == "0-2,5,7-8"
    assert slurm.array_spec([3], None) == "3"


def test_a_task_reports_only_its_own_gpus():
    node = [p.GpuStat(index=i, uuid=f"GPU-{i}") for i in range(4)] + [p.GpuStat(index=4, lost=True)]
    assert slurm.allocated_gpus({"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}) == [2, 3]
    assert slurm.allocated_gpus({"CUDA_VISIBLE_DEVICES": "GPU-1"}) is None
    assert slurm.allocated_gpus({}) is None
    assert [g.index for g in own_gpus(node, [2, 3], "0,1")] == [2, 3]
    assert [g.index for g in own_gpus(node, None, "GPU-1,GPU-3")] == [1, 3]
    assert [g.index for g in own_gpus(node[:1], [2], "0")] == [0]    # a cgroup hides the rest
    assert [g.index for g in own_gpus(node, None, None)] == [0, 1, 2, 3]   # never a lost one


# --- the fold and the judge ---------------------------------------------------------------------

POLICY = Policy(max_restarts=3, backoff_base=2, backoff_max=60, stall_timeout=120)


def submitted(t=1.0, n=1, by="manual", job="40_3"):
    return [p.Launch(t=t, launch=n, by=by, launcher="slurm"), p.Submitted(t=t + 0.1, launch=n, job=job)]


def started(t=5.0, n=1, job="40_3"):
    return [p.Started(t=t, launch=n, pid=99, node="node07", job=job, gpus=[2]),
            p.Loaded(t=t + 1, launch=n), p.Progress(t=t + 2, launch=n, done=4, total=10)]


def live(state="PENDING", reason="Resources", n=1, node=None, job="40_3"):
    return p.TaskState(shard=3, launch=n, job=job, phase=slurm.view(job, state).phase, state=state, reason=reason,
                       node=node)


def slurm_end(*, state, **kw):
    """Slurm's final word as worker.engine.slurm records it."""
    return p.TaskEnded(end=slurm.ENDS[state], state=state, engine="Slurm", **kw)


def verdict(events, now, alive=None, view=None, policy=POLICY):
    return judge(fold(events), alive, now, policy, (), view)


def test_a_submitted_task_is_queued_with_slurms_reason_until_it_starts():
    evs = submitted()
    v = verdict(evs, 2, True, live())
    assert (v.state, v.reason, v.action) == (State.QUEUED, "Resources", Action.NONE)
    assert verdict(evs, 2, True, live(reason=None)).reason is None
    assert verdict(evs[:1], 1, True).reason == "submitting to slurm"
    assert verdict(evs, 2, True, live(n=2)).reason is None                # another launch's word: ignored
    assert verdict(evs, 2, True, live("RUNNING", None, node="node07")).state == State.STARTING
    v = verdict(evs + started(), 8, True, live("RUNNING", None, node="node07"))
    assert v.state == State.RUNNING
    r = fold(evs + started())
    assert (r.attempt.node, r.attempt.job, r.attempt.gpus) == ("node07", "40_3", [2])
    stopped = evs + [p.StopRequested(t=3, launch=1, why="user")]
    assert verdict(stopped, 3, True, live()).reason == "cancelling"


def test_what_slurm_ended_is_a_failure_with_its_reason_restarted_under_the_policy():
    run = submitted() + started()
    # The runner saw the signal first: FAILED, nothing due, until Slurm's final word is recorded.
    signalled = run + [p.Failed(t=9, launch=1, reason="terminated by signal 15", exit_code=143),
                       p.Exited(t=9.5, launch=1, code=143, stopped=True)]
    v = verdict(run + signalled[-2:-1], 9.2, True)
    assert (v.state, v.reason, v.action) == (State.RUNNING, "ending: terminated by signal 15", Action.NONE)
    v = verdict(signalled, 10, False)
    assert (v.state, v.action) == (State.FAILED, Action.NONE)
    assert v.reason == "ended by slurm; waiting for slurm's final word"
    killed = run + [p.Exited(t=9.5, launch=1, code=-15, stopped=True)]
    assert verdict(killed, 10, False).reason == "ended by slurm (signal 15); waiting for slurm's final word"
    late = verdict(signalled, 9.5 + ENGINE_WORD_WAIT_S, False)                # Slurm never said: restart anyway
    assert (late.state, late.action) == (State.BACKOFF, Action.RESTART)
    for state, reason, why in (
            ("TIMEOUT", "TimeLimit", "Slurm TIMEOUT on node07: the task reached its time limit (TimeLimit)"),
            ("PREEMPTED", None, "Slurm PREEMPTED on node07: preempted by a job of higher priority"),
            ("CANCELLED", None, "Slurm CANCELLED on node07: cancelled outside fleet (by an admin, or the engine's own command)")):
        evs = signalled + [slurm_end(t=11, launch=1, job="40_3", state=state, reason=reason, node="node07")]
        v = verdict(evs, 11, False)
        assert (v.state, v.reason, v.action) == (State.BACKOFF, f"{why}; restart in 2s", Action.NONE)
        assert verdict(evs, 11.6, False).action == Action.RESTART        # 2 s after the task's end
        assert fold(evs).last_failure == why and fold(evs).failures == 1
    # A node that died: the agent records Slurm's word and the end the task never wrote.
    dead = run + [slurm_end(t=20, launch=1, job="40_3", state="NODE_FAIL", reason="NodeDown", node="node07"),
                  p.Exited(t=20, launch=1, vanished=True)]
    assert verdict(dead, 20, False).reason == "Slurm NODE_FAIL on node07: its node failed (NodeDown); restart in 2s"
    # Slurm's own memory limit killed the process (the runner was not signalled).
    oom = run + [p.Exited(t=9, launch=1, code=-9), slurm_end(t=10, launch=1, job="40_3", state="OUT_OF_MEMORY",
                                                              node="node07")]
    assert verdict(oom, 10, False).reason.startswith("Slurm OUT_OF_MEMORY on node07: out of memory")
    # Gone from Slurm's memory (no sacct) without an end: said so, and restarted.
    gone = run + [slurm_end(t=30, launch=1, job="40_3", state="UNKNOWN", reason="Slurm no longer lists the task"),
                  p.Exited(t=30, launch=1, vanished=True)]
    assert verdict(gone, 30, False).reason.startswith(
        "the task ended without recording how; Slurm UNKNOWN (Slurm no longer lists the task)")
    # The restart budget holds for Slurm's failures too.
    evs, t = submitted(), 1.0
    for n in range(1, 5):
        t += 100
        evs += [p.Exited(t=t, launch=n, code=-15, stopped=True),
                slurm_end(t=t, launch=n, job=f"{40 + n}_3", state="PREEMPTED")]
        if n < 4:
            evs += submitted(t + 50, n + 1, "auto", f"{41 + n}_3")
    v = verdict(evs, t + 1000, False)
    assert v.state == State.FATAL and v.reason == "gave up after 3 restart(s); last: Slurm PREEMPTED: preempted " \
                                                  "by a job of higher priority"


def test_fleets_own_stops_and_done_are_not_slurms_failures():
    run = submitted() + started()
    # k: the user's stop, whatever Slurm calls it afterwards (CANCELLED), queued or running.
    for evs in (submitted() + [p.StopRequested(t=3, launch=1, why="user"),
                               slurm_end(t=4, launch=1, job="40_3", state="CANCELLED"),
                               p.Exited(t=4, launch=1, vanished=True)],
                run + [p.StopRequested(t=9, launch=1, why="user"), p.Exited(t=9.5, launch=1, code=-15, stopped=True),
                       slurm_end(t=10, launch=1, job="40_3", state="CANCELLED")]):
        v = verdict(evs, 10_000, False)
        assert (v.state, v.reason, v.action) == (State.STOPPED, "stopped", Action.NONE)
    # A restart's stop keeps the failure it restarts from.
    evs = run + [p.StopRequested(t=9, launch=1, why="restart", reason="no progress for 130s"),
                 p.Exited(t=9.5, launch=1, code=-15, stopped=True), slurm_end(t=10, launch=1, state="CANCELLED")]
    assert verdict(evs, 10, False).reason == "no progress for 130s; restart in 2s"
    # DONE is the task's word; Slurm's COMPLETED (or anything later) changes nothing.
    done = run + [p.Done(t=9, launch=1, done=10, total=10), p.Exited(t=9.1, launch=1, code=0),
                  slurm_end(t=10, launch=1, state="COMPLETED")]
    assert verdict(done, 10, False).state == State.DONE
    # Off Slurm, a runner told to stop by a signal is still a user's stop.
    ssh = [p.Launch(t=1, launch=1), p.Started(t=2, launch=1, pid=5), p.Exited(t=3, launch=1, code=-15, stopped=True)]
    assert verdict(ssh, 4, False).state == State.STOPPED


def test_a_fail_line_of_a_slurm_job_is_acted_on_while_it_runs():
    evs = submitted() + started()[:1] + [p.Sentinel(t=7, launch=1, match="fail", line="ERROR: CUDA error")]
    job = Policy(needs_done_sentinel=True, custom_job=True, stall_timeout=None)
    v = judge(fold(evs, True), True, 10, job, (), live("RUNNING", None, node="node07"))
    assert v.state == State.BACKOFF and v.action == Action.RESTART


SLURM_STEP = st.one_of(
    st.tuples(st.just("worker"), st.sampled_from(["started", "loading", "loaded", "progress", "done", "failed",
                                                  "fail_line"])),
    st.tuples(st.just("exit"), st.sampled_from([0, 1, -9])),
    st.tuples(st.just("slurm"), st.sampled_from(["CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "COMPLETED",
                                                 "UNKNOWN"])),
    st.tuples(st.just("user_stop"), st.booleans()),
    st.tuples(st.just("manual"), st.just(0)),
    st.tuples(st.just("time"), st.floats(0.1, 90)),
)


class SlurmWorld(World):
    """World (test_judge.py) where each launch is an array task: launched at submission, started
    by its task, ended by Slurm (the runner's signalled exit and Slurm's word in either order, or
    the agent's record of a task that died with its node)."""

    def launch(self, by: str) -> None:
        self.n += 1
        self.running = True
        self.add(p.Launch(t=self.t, launch=self.n, by=by, launcher="slurm"))
        self.add(p.Submitted(t=self.t, launch=self.n, job=f"{self.n}_0"))

    def step(self, kind, arg) -> None:
        if kind == "worker" and arg == "started" and self.running:
            self.add(p.Started(t=self.t, launch=self.n, pid=7, node="n1", job=f"{self.n}_0"))
        elif kind == "slurm":
            end = slurm_end(t=self.t, launch=self.n, job=f"{self.n}_0", state=arg)
            if not self.running:
                self.add(end)                                   # a late word: ignored or refining
            elif arg in ("NODE_FAIL", "UNKNOWN"):
                self.add(end)
                self.end(vanished=True)
            else:
                self.end(code=-15, stopped=True)
                self.add(end)
        else:
            super().step(kind, arg)


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(SLURM_STEP, max_size=60), max_restarts=st.integers(0, 4))
def test_judge_invariants_hold_over_random_slurm_histories(steps, max_restarts):
    policy = Policy(max_restarts=max_restarts, backoff_base=1, backoff_max=8, stall_timeout=30)
    w = SlurmWorld(policy)
    for kind, arg in steps:
        w.step(kind, arg)
        w.supervise()
    assert_within_restart_budget(w.events, max_restarts)
    for length, t, alive, live in w.checkpoints:    # the live verdict then, and the prefix replayed
        assert judge(fold(w.events[:length]), alive, t, policy) == live
    final = judge(w.live, w.running, w.t, policy)
    assert final == judge(fold(w.events), w.running, w.t, policy)
    if final.state in SETTLED:
        w.t += 10_000
        assert judge(w.live, w.running, w.t, policy).action == Action.NONE
    # A user's stop is never turned into a failure by what Slurm says afterwards.
    a = w.live.attempt
    if a is not None and a.ended and a.stop is not None and a.stop.final and final.state != State.DONE:
        assert final.state == State.STOPPED


# --- the snapshot ---------------------------------------------------------------------------------

def test_the_snapshot_shows_a_slurm_shard_on_its_node_and_groups_gpus_by_node():
    login = Host("slurm", "alice@login", reachable=True, replayed=True, role="login")
    running = fold(submitted(job="40_0") + started(job="40_0"))
    queued = fold(submitted(job="41_1"))
    readings = [("node07", p.TaskGpus(shard=0, launch=1, node="node07", t=100.0, source="nvml",
                                      gpus=[p.GpuStat(index=2, mem_used=5, mem_total=10)])),
                ("node07", p.TaskGpus(shard=2, launch=1, node="node07", t=99.0, source="nvml",
                                      gpus=[p.GpuStat(index=0, mem_used=1, mem_total=10)])),
                ("node09", None)]
    nodes = task_nodes(login, readings)
    assert sorted(nodes) == ["node07", "node09"]
    n7 = nodes["node07"]
    assert [g.index for g in n7.gpus] == [0, 2] and n7.gpu_t == 99.0 and n7.telemetry == "nvml"
    assert nodes["node09"].gpus == [] and nodes["node09"].telemetry is None and n7.role == "node"
    views = [ShardView(0, "slurm", 2, running, judge(running, True, 8, POLICY), True, 99, 3, node="node07",
                       task=task_status(running, live("RUNNING", None, node="node07", job="40_0"))),
             ShardView(1, "slurm", 0, queued, judge(queued, True, 2, POLICY, (), live(job="41_1")), True, None, 3,
                       task=task_status(queued, live(job="41_1")))]
    snap = build_snapshot("r", views, {"slurm": login, **nodes}, now=8, expected=ExpectedSpec(samples_per_s_per_gpu=2))
    s0, s1 = snap.shards
    assert (s0.host, s0.gpu, s0.state, s0.task.job, s0.task.state) == ("node07", 2, State.RUNNING, "40_0", "RUNNING")
    assert (s1.host, s1.state, s1.reason, s1.task.reason, s1.faulty) == ("slurm", State.QUEUED, "Resources",
                                                                          "Resources", False)
    assert snap.totals.expected_per_s == 2.0                               # the queued shard is not expected
    assert [(h.name, h.role) for h in snap.hosts] == [("slurm", "login"), ("node07", "node"), ("node09", "node")]
    assert [g.index for g in snap.host("node07").gpus] == [0, 2]
    # Unreachable login node: every node is unknown too, never zero.
    login.reachable, login.error = False, "connection refused"
    import dataclasses                                   # the store judges them with the host's word
    views = [dataclasses.replace(v, verdict=judge(v.record, True, 8, POLICY, host_down=login.down_reason))
             for v in views]
    snap = build_snapshot("r", views, {"slurm": login, **task_nodes(login, readings)}, now=8,
                          expected=ExpectedSpec())
    assert {s.state for s in snap.shards} == {State.UNKNOWN} and snap.host("node07").gpus is None
    # The record's word when Slurm says nothing live: the job and its final state.
    ended = fold(submitted() + started() + [p.Exited(t=9, launch=1, code=-15, stopped=True),
                                            slurm_end(t=10, launch=1, job="40_3", state="TIMEOUT", node="node07")])
    assert task_status(ended, None).model_dump() == {"job": "40_3", "phase": "ended", "state": "TIMEOUT", "reason": None,
                                                 "node": "node07"}
    assert task_status(fold([p.Launch(t=1, launch=1)]), None) is None
    assert json.loads(snap.to_json())["shards"][0]["task"]["job"] == "40_0"
