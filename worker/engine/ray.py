"""Ray, from any node of the cluster (`[ray] login`): each shard's launch is one detached Ray actor
that runs the shard as the SSH runner does (`python -m worker.hostctl task`), placed by Ray on a
node with the GPUs and resources it asks for; asked about with Ray's state API, ended by a stop the
actor carries out (the runner's own SIGTERM, then Ray's kill). What every engine of tasks shares is
worker/engine/tasks.py; this module translates Ray's actor states into its neutral words.

    python -m worker.engine.ray --options JSON check [--shards N]
    python -m worker.engine.ray --options JSON submit --run-dir R      (the submission on stdin)
    python -m worker.engine.ray --options JSON cancel --run-dir R --shard K ...
    python -m worker.engine.ray --options JSON cancel-all --run-dir R [--job-name N]

An actor is named `<job name>-<shard>-<launch>` in the run's namespace: its name is the task's
name in the shard's record. It ends when its shard's process does (so its GPUs go back to Ray);
the process dies with the actor (a lost node takes both), and its rows, shared by the run's shards
through the ledger in the run's folder, are taken by the others. `ray` is imported only here, and
only inside the functions that use it: the rest of the worker never needs it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from .. import protocol
from .tasks import Engine, EngineError, TaskPlace, View, gpu_indices, main as tasks_main, unknown

# Ray's actor states, as the neutral phases (protocol.TASK_PHASES).
PHASES = {"DEPENDENCIES_UNREADY": "queued", "PENDING_CREATION": "queued", "ALIVE": "running",
          "RESTARTING": "queued", "DEAD": "ended"}
# How an actor died (its death cause's reason), as the neutral ends of protocol.TASK_ENDS.
ENDS = {"INTENDED_USER_EXIT": "completed", "INTENDED_SYSTEM_EXIT": "completed", "RAY_KILL": "cancelled",
        "NODE_DIED": "node_lost", "OUT_OF_MEMORY": "out_of_memory", "WORKER_DIED": "failed",
        "USER_CODE_EXCEPTION": "failed", "RUNTIME_ENV_FAILED": "failed"}
NODE_ENV, JOB_ENV, GPUS_ENV = "FLEET_TASK_NODE", "FLEET_TASK_JOB", "FLEET_TASK_GPUS"
STOP_GRACE_S = 30.0                  # an actor's stop: SIGTERM to the shard, SIGKILL after this
RAY_LIST_LIMIT = 10_000              # the most actors Ray's state API lists at once (its own cap)


def death(actor: dict) -> tuple[str, str | None]:
    """(the death cause's reason, its message) from the state API's actor."""
    cause = actor.get("death_cause") or {}
    for context in cause.values():
        if isinstance(context, dict):
            reason = context.get("reason") or context.get("error_type")
            return str(reason or "UNKNOWN"), context.get("error_message")
    return "UNKNOWN", None


def node_name(node: dict) -> str:
    """A Ray node as fleet shows it: its name (`ray start --node-name`; Ray's default, its IP), and
    the start of its id (several nodes may share an IP)."""
    return f"{node.get('NodeName') or node.get('node_name') or 'node'}-{str(node.get('NodeID') or node.get('node_id'))[:6]}"


def view(job: str, actor: dict | None, nodes: dict[str, str]) -> View:
    """One actor as a neutral View; None (not listed) is a task Ray no longer knows."""
    if actor is None:
        return unknown(job, "Ray no longer lists the actor")
    state = str(actor.get("state") or "UNKNOWN")
    node = nodes.get(str(actor.get("node_id") or "")) or None
    phase = PHASES.get(state, "running")
    if phase != "ended":
        why = "waiting for Ray to place it" if phase == "queued" else None
        return View(job, phase, state, why, node)
    reason, message = death(actor)
    return View(job, "ended", reason, first_sentence(message), node, ENDS.get(reason, "unknown"))


def first_sentence(message: str | None) -> str | None:
    """"The actor died because its node has died. Node Id: ..." -> its first sentence."""
    text = (message or "").strip().splitlines()[0] if message and message.strip() else ""
    return (text.split(". ")[0].rstrip(".")[:200] or None) if text else None


def _actor_class():
    """The actor, defined here so Ray ships it by value: a Ray worker needs nothing of fleet's
    installed to create it (the shard's own process finds the deployed worker on PYTHONPATH)."""
    import ray

    class FleetShard:
        def __init__(self, argv: list[str], env: dict[str, str], log: str):
            import ctypes
            import signal
            import subprocess
            import threading
            context = ray.get_runtime_context()
            node_id = context.get_node_id()
            node = next((n for n in ray.nodes() if n.get("NodeID") == node_id), {"NodeID": node_id})
            gpus = [int(g) for g in ray.get_gpu_ids() if str(g).isdigit()]
            env = {**os.environ, **env, NODE_ENV: node_name(node), GPUS_ENV: ",".join(map(str, gpus))}
            libc = ctypes.CDLL(None, use_errno=True)

            def die_with_actor():                       # a lost actor (its node, Ray's kill) takes the shard
                libc.prctl(1, signal.SIGKILL)           # PR_SET_PDEATHSIG
            self.proc: subprocess.Popen | None = None
            started = threading.Event()

            def run():
                with open(log, "ab") as out:
                    self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                                 stderr=subprocess.STDOUT, preexec_fn=die_with_actor)
                started.set()
                self.proc.wait()
                os._exit(0)                              # the shard ended: the actor with it
            threading.Thread(target=run, daemon=True).start()   # (this thread lives as long as the child)
            started.wait()

        def stop(self, grace: float) -> bool:
            """The shard's runner, told as a stop tells it (SIGTERM: it ends the shard's process
            group, records its end); SIGKILL after `grace`. True once it has ended."""
            import signal
            import subprocess
            if self.proc is None:
                return True
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            return True

    return ray.remote(FleetShard)


class Ray(Engine):
    """`options`: fleet.toml's [ray] as the hosts need it (address, namespace, dashboard)."""
    key = "ray"
    label = "Ray"

    def __init__(self, options: dict):
        self.address = options.get("address") or "auto"
        self.namespace = options.get("namespace") or "fleet"
        self.dashboard = options.get("dashboard")

    def connect(self):
        """ray, connected to the cluster (once a process); EngineError when it cannot be."""
        try:
            import ray
        except ImportError:
            raise EngineError(f"ray is not installed for {sys.executable} on {socket.gethostname()} "
                              "(pip install 'ray[default]')") from None
        if not ray.is_initialized():
            try:
                # (ray types logging_level int, but takes a level's name too: its own default is "info")
                ray.init(address=self.address, namespace=self.namespace, logging_level="ERROR",  # type: ignore[arg-type]
                         log_to_driver=False, configure_logging=False)
            except Exception as e:
                raise EngineError(f"Ray cluster at {self.address} does not answer: "
                                  f"{str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
        return ray

    def views_of(self, jobs: list[str]) -> dict[str, View]:
        ray = self.connect()
        from ray.util.state import list_actors
        try:
            actors = list_actors(address=self.dashboard, filters=[("ray_namespace", "=", self.namespace)],
                                 detail=True, limit=RAY_LIST_LIMIT, raise_on_missing_output=False)
            nodes = {str(n.get("NodeID")): node_name(n) for n in ray.nodes()}
        except Exception as e:
            raise EngineError(f"Ray's state API did not answer: {str(e).strip().splitlines()[0][:200]}") from None
        newest: dict[str, dict] = {}
        for actor in actors:                # ActorState as typed; a dict from some Ray versions
            a: dict = actor if isinstance(actor, dict) else actor.__dict__
            name = a.get("name")
            if name in jobs and (name not in newest or newest[name].get("state") == "DEAD"):
                newest[name] = a                # a name Ray reuses: the live one
        return {job: view(job, newest.get(job), nodes) for job in jobs}

    def start(self, run_dir: str, spec: dict, launches: dict[str, int],
              submission: str) -> tuple[dict[str, str], str | None, str | None]:
        self.connect()
        actor = _actor_class()
        request = spec.get("ray", {})
        jobs: dict[str, str] = {}
        error = None
        env = {"PYTHONPATH": spec["pythonpath"]}
        for k, n in launches.items():
            name = f"{spec['job_name']}-{k}-{n}"
            argv = [spec["python"], "-m", "worker.hostctl", "task", "--engine", "ray", "--submission", submission,
                    "--index", k]
            log = os.path.join(protocol.shard_dir(run_dir, int(k)), protocol.LOG_FILE)
            try:
                actor.options(name=name, namespace=self.namespace, lifetime="detached", max_restarts=0,
                              num_gpus=request.get("num_gpus", 0), num_cpus=request.get("num_cpus", 1),
                              resources=request.get("resources") or None,
                              runtime_env=request.get("runtime_env") or None).remote(
                    argv, {**env, JOB_ENV: name}, log)
                jobs[k] = name
            except Exception as e:
                error = f"Ray refused the actor: {str(e).strip().splitlines()[0][:200]}"
        return jobs, error, f"{len(jobs)} actor(s) {spec['job_name']}-<shard>-<launch> in namespace {self.namespace}"

    def end(self, jobs: list[str], job_name: str | None = None) -> str | None:
        ray = self.connect()
        names = set(jobs)
        if job_name:
            from ray.util.state import list_actors
            try:
                names |= {a.name for a in list_actors(address=self.dashboard, limit=RAY_LIST_LIMIT,
                                                      filters=[("ray_namespace", "=", self.namespace),
                                                               ("state", "=", "ALIVE")])
                          if a.name and a.name.startswith(f"{job_name}-")}
            except Exception as e:
                return f"Ray's state API did not answer: {str(e).strip().splitlines()[0][:200]}"
        handles = {}
        for name in names:
            try:
                handles[name] = ray.get_actor(name, namespace=self.namespace)
            except ValueError:                  # already gone
                continue
        stops = {name: h.stop.remote(STOP_GRACE_S) for name, h in handles.items()}
        for name, ref in stops.items():
            try:
                ray.get(ref, timeout=STOP_GRACE_S + 10)
            except Exception:                   # the actor died meanwhile, or would not stop: Ray's kill
                try:
                    ray.kill(handles[name], no_restart=True)
                except Exception:
                    pass
        return None

    def check(self, args: argparse.Namespace) -> protocol.EngineCheck:
        report = protocol.EngineCheck()
        try:
            ray = self.connect()
        except EngineError as e:
            report.checks.append(protocol.Check("error", str(e)))
            return report
        report.version = ray.__version__
        try:
            from ray.util.state import list_actors
            list_actors(address=self.dashboard, limit=1, filters=[("ray_namespace", "=", self.namespace)])
            report.accounting = True
        except Exception as e:
            report.checks.append(protocol.Check("error", "Ray's state API (the dashboard) does not answer: "
                                                f"{str(e).strip().splitlines()[0][:200]}; start the head with "
                                                "ray[default] installed, or give [ray] dashboard"))
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if not alive:
            report.checks.append(protocol.Check("error", f"the Ray cluster at {self.address} has no live node"))
        elif len(alive) > 1 and args.run_dir:
            folders = [("root", args.run_dir)] + ([] if args.shipped or not args.output else [("output", args.output)])
            for line in unshared(ray, alive, folders):
                report.checks.append(protocol.Check("error", line))
        return report

    def task_place(self, index: str | None) -> TaskPlace:
        if index is None:
            raise EngineError("a Ray task is told its shard (--index)")
        node = os.environ.get(NODE_ENV) or socket.gethostname().split(".")[0]
        return TaskPlace(index, node, os.environ.get(JOB_ENV, "?"), gpu_indices(os.environ.get(GPUS_ENV)))


def unshared(ray, nodes: list[dict], folders: list[tuple[str, str]]) -> list[str]:
    """What of `folders` (what, path) some node does not see: a marker written here, looked for by
    one task on each node. With more than one node the run's records and leases (root) and its
    output (unless shipped to a destination) must be on storage every node mounts."""
    import secrets
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    name = f".fleet-shared-{secrets.token_hex(6)}"
    markers = []
    for _, path in folders:
        os.makedirs(path, exist_ok=True)
        markers.append(os.path.join(path, name))
        with open(markers[-1], "w") as f:
            f.write("fleet: seen from every node?\n")

    def sees(paths: list[str]) -> list[bool]:
        return [os.path.exists(p) for p in paths]
    answers: dict[str, list[bool]] = {}
    try:
        probe = ray.remote(num_cpus=0)(sees)
        refs = {node_name(n): probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            n["NodeID"], soft=False)).remote(markers) for n in nodes}
        for node, ref in refs.items():
            try:
                answers[node] = ray.get(ref, timeout=120)
            except Exception as e:
                if "doesn't exist any more" in str(e):     # a node lost since it was listed: no actor goes there
                    continue
                return [f"could not ask Ray node {node} whether it sees the run's folders: {first_sentence(str(e))}"]
    finally:
        for m in markers:
            try:
                os.unlink(m)
            except OSError:
                pass
    out = []
    for i, (what, path) in enumerate(folders):
        blind = sorted(node for node, seen in answers.items() if not seen[i])
        if blind:
            fix = "give [run] destination, or " if what == "output" else ""
            out.append(f"{what} {path} is not seen from Ray node(s) {', '.join(blind)}: with more than one "
                       f"node every actor reads and writes it, so it must be on storage every node mounts "
                       f"({fix}put it on NFS, CephFS, Lustre or a shared volume)")
    return out


def make(options: dict) -> Ray:
    return Ray(options)


if __name__ == "__main__":
    sys.exit(tasks_main("ray", make))
