"""Ray as the launcher, against a real Ray cluster started as a user starts one (tests/ray_cluster.py:
`ray start --head`, a second node with `ray start --address`, each advertising logical GPUs that the
tests' CPU shards take): the tiny model as one actor per shard; an actor killed and a node lost under
a run whose supervisor was stopped, then a supervisor that joins the run it did not start, restarts
what was lost and finishes it with every row written once; `fleet status --json` against the schema,
`fleet logs` reading an actor's log, `fleet verify`. Ray's daemons are stopped after every test."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import jsonschema
import pytest

from tests.conftest import REPO, wait_for
from tests.fleet.conftest import fleet, fleet_popen, stop_supervisor
from tests.fleet.test_slurm import events, of, run_and_job       # the same run folder's layout (tmp_path/shared, run t)
from worker import protocol
from worker.hostctl import shard_processes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.ray

ROWS = 600          # two shards of 300: n2's half is far from done when the node is lost, 10 rows in


@pytest.fixture
def ray_cluster(request):
    """A head node with one GPU (`indirect` parametrization: another count)."""
    from tests.ray_cluster import RayClusterError, start_ray
    gpus = getattr(request, "param", 1)
    try:
        cluster = start_ray(head_gpus=gpus, head_cpus=max(1, gpus))
    except RayClusterError as e:
        pytest.fail(str(e))
    try:
        yield cluster
    finally:
        cluster.stop()


def ray_toml(tmp_path, cluster, *, model: str | None = None, data: str | None = None, shards: int,
             script: dict | None = None, env: dict[str, str] | None = None) -> str:
    """A [ray] run on `cluster` whose root and output are under tmp_path/shared; `script`: a [job]
    of tests/jobs/scripted_job.py instead of the built-in worker; `env`: more of [run] env."""
    shared = tmp_path / "shared"
    run, job = run_and_job(tmp_path, model, data, script)
    text = f"""
[run]
name = "t"
{run}output = {json.dumps(str(shared / 'out'))}
max_tokens_per_batch = 512
device = "cpu"
env = {{ {", ".join(f"{k} = {json.dumps(v)}" for k, v in {"OMP_NUM_THREADS": "1", **(env or {})}.items())} }}

[supervise]
stall_timeout = "120s"
backoff_base = "0.5s"
backoff_max = "2s"
{job}
[ray]
address = "{cluster.address}"
num_cpus = 0
shards = {shards}
root = {json.dumps(str(shared / 'fleet'))}
python = {json.dumps(sys.executable)}
poll_interval = "1s"
"""
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return str(path)




def node_of(tmp_path, shard: int) -> str | None:
    started = [e for e in of(protocol.Started, events(tmp_path, shard)) if e.node]
    return started[-1].node if started else None


def all_ended_in_rays_word(cluster, jobs: list[str]) -> bool:
    """Whether Ray says every one of `jobs` has ended (worker.engine.ray's own view of them), asked
    from a process of its own: a test process that called ray.init() would be a driver of the
    cluster, and Ray ends a driver whose cluster is gone (_exit, a minute after the cluster's stop,
    in whatever test this xdist worker runs by then)."""
    code = ("import json, sys; from worker.engine.ray import Ray; "
            "views = Ray({'address': sys.argv[1]}).views_of(json.loads(sys.argv[2])); "
            "print(json.dumps(all(v.terminal for v in views.values())))")
    r = subprocess.run([sys.executable, "-c", code, cluster.address, json.dumps(jobs)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    return r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == ["true"]


def written(tmp_path, shard: int) -> int:
    return max([e.done for e in of(protocol.Progress, events(tmp_path, shard))], default=0)


def manifest_indices(tmp_path) -> list[int]:
    out = []
    folder = tmp_path / "shared" / "out" / "manifest"
    for name in os.listdir(folder):
        out += [json.loads(line)["index"] for line in open(folder / name) if line.strip()]
    return out


def test_a_lost_node_and_a_killed_actor_under_a_supervisor_that_joins_later(tmp_path, ray_cluster, dense_model):
    from worker.demo import make_token_dataset
    ray_cluster.add_node("n2", gpus=1)
    data = make_token_dataset(str(tmp_path / "d.jsonl"), ROWS, vocab_size=500, mean_tokens=40, seed=5)
    # Every batch a fifth of a second slower (tests/faults/inject, on the GPU Ray gives each actor):
    # a shard takes seconds, not one, so n2's is caught part-way on any machine.
    inject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "faults", "inject")
    config = ray_toml(tmp_path, ray_cluster, model=dense_model, data=data, shards=2,
                      env={"PYTHONPATH": inject, "FLEET_INJECT_SLOW_GPU": "0:0.2"})
    up = fleet_popen("up", "--headless", "-c", config)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(up.stdout), daemon=True)
    reader.start()
    try:
        # Ray places the two actors on both nodes (one GPU each).
        wait_for(lambda: all(node_of(tmp_path, k) for k in range(2)), 240, 0.5, what="both actors started")
        nodes = {k: node_of(tmp_path, k) for k in range(2)}
        on_n2 = [k for k, n in nodes.items() if n.startswith("n2-")]
        on_head = [k for k, n in nodes.items() if n.startswith("head-")]
        assert len(on_n2) == 1 and len(on_head) == 1, nodes
        # n2's shard frozen as soon as it writes (its processes, found by the environment they
        # inherit), so it is cut off part-way however fast this machine is and whenever the head's
        # starts; the node's loss kills them (SIGKILL reaches a stopped process).
        wait_for(lambda: all(written(tmp_path, k) >= 10 for k in on_n2), 240, 0.2, what="n2's shard writing")
        for k in on_n2:
            for pid in shard_processes(str(tmp_path / "shared" / "fleet" / "t" / "shards" / str(k))):
                os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: all(written(tmp_path, k) >= 10 for k in on_head), 240, 0.5, what="the head's shard writing")
        # The supervisor goes; the run goes on without it.
        up.send_signal(signal.SIGINT)
        up.wait(60)
        stop_supervisor(config)
        # An actor killed (its Ray worker process), and a node lost with both its actors.
        killed = on_head[0]
        runner = int(open(tmp_path / "shared" / "fleet" / "t" / "shards" / str(killed) / "runner.pid").read())
        actor_pid = int(open(f"/proc/{runner}/stat").read().rsplit(")", 1)[1].split()[1])
        os.kill(actor_pid, signal.SIGKILL)
        ray_cluster.remove_node("n2")
        lost_at = {k: written(tmp_path, k) for k in on_n2}
    finally:
        if up.poll() is None:
            up.kill()
        print("".join(lines))                        # shown when the test fails
    # A new supervisor joins the run it did not start: it sees what Ray says happened, restarts the
    # lost shards under the policy, and the rows of the lost node are done by the head's actors.
    try:
        r = fleet("up", "--headless", "-c", config, timeout=400)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the joining supervisor did not finish: {e.stdout}{e.stderr}") from None
    assert r.returncode == 0, r.stdout + r.stderr
    for k in on_n2:
        evs = events(tmp_path, k)
        [end] = [e for e in of(protocol.TaskEnded, evs) if e.launch == 1]
        assert (end.end, end.state, end.engine) == ("node_lost", "NODE_DIED", "Ray"), end
        assert of(protocol.Launch, evs)[-1].launch >= 2 and of(protocol.Launch, evs)[-1].launcher == "ray"
        assert node_of(tmp_path, k).startswith("head-")                # placed again on the live node
        assert lost_at[k] < ROWS // 2                                  # it was cut off part-way
    evs = events(tmp_path, killed)
    assert [e.end for e in of(protocol.TaskEnded, evs) if e.launch == 1] == ["failed"]
    assert of(protocol.Launch, evs)[-1].launch >= 2
    assert f"shard {killed}" in r.stdout and "DONE" in r.stdout
    # Every row once, on the shared output.
    assert sorted(manifest_indices(tmp_path)) == list(range(ROWS))
    v = fleet("verify", "-c", config)
    assert v.returncode == 0 and f"{ROWS} written" in v.stdout, v.stdout + v.stderr
    st = fleet("status", "--json", "-c", config)
    snap = json.loads(st.stdout)
    jsonschema.validate(snap, json.loads(fleet("status", "--json-schema").stdout))
    assert st.returncode == 0 and {s["state"] for s in snap["shards"]} == {"DONE"}
    assert snap["hosts"][0]["name"] == "ray" and snap["hosts"][0]["role"] == "login"
    assert {h["role"] for h in snap["hosts"][1:]} == {"node"}
    assert all(s["task"]["job"].startswith("fleet-t-") for s in snap["shards"])
    logs = fleet("logs", str(on_n2[0]), "-c", config)
    assert logs.returncode == 0 and "done" in logs.stdout, logs.stdout + logs.stderr


def test_preflight_refuses_an_output_a_node_does_not_see(tmp_path, ray_cluster, dense_model, token_data):
    """A second node whose output folder is its own disk (a tmpfs over it in its mount namespace):
    with more than one node every actor writes the output, so preflight refuses and says why."""
    config = ray_toml(tmp_path, ray_cluster, model=dense_model, data=token_data, shards=2)
    out = tmp_path / "shared" / "out"
    ray_cluster.add_node("n2", gpus=1, hide=str(out))
    r = fleet("up", "--headless", "-c", config, timeout=300)
    assert r.returncode != 0
    assert f"output {out} is not seen from Ray node(s) n2-" in r.stderr, r.stdout + r.stderr
    assert "root" not in r.stderr.split("preflight refused:")[-1].split("output")[0]   # the root is shared
    assert not (tmp_path / "shared" / "fleet" / "t" / "shards").exists() or \
        not any((tmp_path / "shared" / "fleet" / "t" / "shards").iterdir())            # nothing launched


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is installed by scripts/test.sh")
@pytest.mark.parametrize("ray_cluster", [2], indirect=True, ids=["two-gpus"])
def test_r_x_and_D_in_the_live_view_restart_and_stop_ray_actors(tmp_path, ray_cluster):
    """The keys mean what they mean for the other engines, in a real terminal: `r` stops the shard's
    actor and creates a new one, `x` stops one (STOPPED, its actor gone), `D` the run."""
    from tests.fleet.test_tui import Tmux
    ticks = [[["ticks", 100000, 0.5]]]
    config = ray_toml(tmp_path, ray_cluster, shards=2, script={"0": ticks, "1": ticks})
    tmux = Tmux("fleet-ray")
    tmux.start(f"cd {REPO} && {sys.executable} -m fleet.cli up -c {config}; sleep 60", 120, 30)

    wait_screen = tmux.wait
    keys = lambda *k: tmux("send-keys", "-t", tmux.session, *k, check=True)    # noqa: E731
    launches = lambda k: [e for e in of(protocol.Launch, events(tmp_path, k))]  # noqa: E731
    try:
        wait_screen(lambda t: t.count("▶ RUNNING") >= 2 and "head-" in t, "two actors running on the head node")
        keys("r")
        wait_screen(lambda t: "Restart shard(s) 0?" in t, "the restart question")
        keys("y")
        wait_for(lambda: len(launches(0)) == 2 and node_of(tmp_path, 0) and
                 [e for e in of(protocol.Started, events(tmp_path, 0)) if e.launch == 2], 120, 0.3,
                 what="shard 0's new actor started")
        wait_screen(lambda t: t.count("▶ RUNNING") >= 2, "both running again")
        assert [(e.launch, e.by, e.launcher) for e in launches(0)] == [(1, "manual", "ray"), (2, "manual", "ray")]
        [stop] = [e for e in of(protocol.StopRequested, events(tmp_path, 0))]
        assert (stop.launch, stop.why) == (1, "restart")
        assert not of(protocol.TaskEnded, events(tmp_path, 0))      # its own end said it all: nothing of Ray's
        keys("j", "x")
        wait_screen(lambda t: "Stop shard(s) 1?" in t, "the stop question")
        keys("y")
        wait_screen(lambda t: "■ STOPPED" in t, "shard 1 stopped")
        assert any(e.why == "user" for e in of(protocol.StopRequested, events(tmp_path, 1)))
        assert len(launches(1)) == 1
        keys("D")
        wait_screen(lambda t: "Stop the WHOLE run" in t, "the run's stop question")
        keys("D")                                                      # the run's own key confirms it
        wait_screen(lambda t: t.count("■ STOPPED") >= 2, "every shard stopped")
        jobs = [e.job for k in (0, 1) for e in of(protocol.Submitted, events(tmp_path, k))]
        wait_for(lambda: all_ended_in_rays_word(ray_cluster, jobs), 60, 0.5,
                 what="every actor gone in Ray's word (none left holding a GPU)")
    finally:
        tmux.stop()
        fleet("down", "--yes", "-c", config)
