"""What every engine that queues shards as tasks shares on the supervisor's side (`TaskLauncher`):
the one host fleet talks to is the engine's login (or head) node, named as the engine; a shard is a
task there, placed by the engine on its nodes and GPUs (which its record and the engine's word say);
launches are one `python -m worker.engine.<name> submit` for all of them, stops and restarts of live
tasks `cancel`, the run's stop `cancel-all`; the snapshot shows each node a shard runs on as a host,
with the GPUs the tasks report from inside their allocations.

An engine adds only its own: what a submission asks of it (`engine_request`), its checks'
arguments, and whether its tasks share their rows (`pool`).
"""

from __future__ import annotations

import json
from typing import ClassVar

from worker import protocol

from .. import deploy
from ..bundle import code_dir
from ..config import HostSpec, TaskEngineSpec
from ..hosts import Host
from ..jobs import Placement, sentinel_spec, shard_command
from ..record import ShardRecord
from ..schema import Gpu, TaskStatus
from ..snapshot import ShardView
from ..store import Shard, Store
from ..transport import Transport
from .base import Engine


class TaskLauncher(Engine):
    pinned = False
    label: ClassVar[str] = ""             # the engine's name for people ("Slurm NODE_FAIL on ...")
    shares_rows: ClassVar[bool] = False   # a run's tasks share their rows (a ledger every node sees)

    @property
    def spec(self) -> TaskEngineSpec:
        spec = self.config.tasks
        assert spec is not None
        return spec

    @property
    def module(self) -> str:
        return f"engine.{self.kind}"

    def options(self) -> list[str]:
        return ["--options", json.dumps(self.spec.host_options())]

    def place(self, gpus_by_host: dict[str, list[int]]) -> list[Placement]:
        """One shard per task, `shards` of them; its GPUs are the task's own (0..k-1 of what the
        engine gives it)."""
        k = self.config.run.gpus_per_shard
        return [Placement(n, self.config.hosts[0].name, 0, tuple(range(k)) if k > 1 else (), pinned=False)
                for n in range(self.spec.shards)]

    @staticmethod
    def layout_differences(old: protocol.Plan, new: protocol.Plan) -> list[str]:
        """The engine picks the nodes and GPUs: two plans differ only in their shard count."""
        return [f"shards: {old.num_shards} -> {new.num_shards}"] if old.num_shards != new.num_shards else []

    def first_hosts(self) -> dict[str, Host]:
        return {h.name: Host(h.name, self.spec.login, role="login", usd_per_hour=h.usd_per_hour)
                for h in self.config.hosts}

    def view(self, shard: Shard, view: ShardView) -> ShardView:
        """A shard shows its task, and its node (and the first GPU the engine gave it) once it started."""
        a = shard.record.attempt
        view.task = task_status(shard.record, shard.task)
        if a is None:
            return view
        node = a.node or (view.task.node if view.task else None)
        if node:
            view.node, view.gpu = node, (a.gpus[0] if a.gpus else view.gpu)
            view.gpus = tuple(a.gpus) if a.gpus else view.gpus
        return view

    def nodes(self, store: Store) -> dict[str, Host]:
        """One host per node the shards run or ran on, carrying the GPUs their live tasks report."""
        tasks = []
        for s in store.shards.values():
            a = s.record.attempt
            if a is None:
                continue
            live = task_status(s.record, s.task)
            node = a.node or (live.node if live else None)
            if node:
                reporting = s.alive and not a.ended and s.gpus is not None and s.gpus.launch == a.n
                tasks.append((node, s.gpus if reporting else None))
        return task_nodes(store.hosts[self.config.hosts[0].name], tasks)

    def preflight_gpus(self, host: HostSpec) -> tuple[str, str]:
        """The login node's GPUs are not the run's: the engine allocates them."""
        return ",".join(map(str, range(self.config.run.gpus_per_shard))), "cpu"

    async def host_checks(self, t: Transport, host: HostSpec, result: deploy.Preflight) -> str:
        """The engine's `check` on the login node (it answers; what the run asks of it exists)."""
        result.gpus = []
        report = result.report
        report.engine = await deploy.run_worker_module(
            t, self.config, host, self.module, *self.options(), "check", "--shards", str(self.spec.shards),
            "--run-dir", self.config.run_dir(host), "--output", self.config.output_dir(host),
            *(["--shipped"] if self.config.run.destination is not None else []),
            reply=protocol.EngineCheck, timeout=180)
        report.checks = report.checks + report.engine.checks
        return f"{self.label} allocates the GPUs"

    def engine_request(self) -> dict:
        """What the engine's `start` reads of a submission beside the tasks (its own options)."""
        return {}

    def submission(self, host: HostSpec, places: list[Placement], num_shards: int, by: str) -> dict:
        """What `worker.engine.<name> submit` reads on stdin for these shards."""
        pool = tuple(range(num_shards)) if self.shares_rows else ()
        tasks = {}
        for place in places:
            cmd = shard_command(self.config, host, place, num_shards, pool)
            tasks[str(place.shard)] = protocol.LaunchSpec(argv=cmd.argv, env=cmd.env, cwd=cmd.cwd,
                                                          sentinels=sentinel_spec(self.config, host),
                                                          rows=cmd.rows).to_dict()
        return {"job_name": self.config.job_name, "by": by, "python": self.config.python(host),
                "pythonpath": code_dir(self.config, host), "tasks": tasks, **self.engine_request()}

    async def act(self, t: Transport, host: HostSpec, actions: list[protocol.ShardAction],
                  places: dict[int, Placement], num_shards: int,
                  wait: float = 0.0) -> list[protocol.ActResult]:
        if actions and all(a.kind == "stop" and a.why == "run" for a in actions):
            return await self._cancel_all(t, host, actions, wait)
        results: dict[int, protocol.ActResult] = {}
        submit: dict[str, list[int]] = {}
        for a in actions:
            if a.kind == "launch":
                submit.setdefault(a.by, []).append(a.shard)
                continue
            r = await self._cancel(t, host, a, wait)
            if a.kind == "restart" and r.status == "not running":
                submit.setdefault(a.by, []).append(a.shard)
                continue
            status = {"stopped": "stopped", "not running": "not running", "error": "error"}.get(
                r.status, "restarting" if a.kind == "restart" else "stopping")
            results[a.shard] = protocol.ActResult(shard=a.shard, status=status, detail=r.error)
        for by, shards in submit.items():
            results.update(await self._submit(t, host, [places[k] for k in shards], num_shards, by))
        return [results[a.shard] for a in actions if a.shard in results]

    async def _cancel(self, t: Transport, host: HostSpec, a: protocol.ShardAction,
                      wait: float) -> protocol.Cancellation:
        timeout = max(a.grace, 60.0)
        args = ["cancel", "--run-dir", self.config.run_dir(host), "--shard", str(a.shard), "--why", a.why,
                "--timeout", str(timeout if wait else 1.0)]
        if a.reason:
            args += ["--reason", a.reason]
        if a.kind == "restart":
            args += ["--then", "launch", "--by", a.by]
        return await deploy.run_worker_module(t, self.config, host, self.module, *self.options(), *args,
                                              reply=protocol.Cancellation, timeout=timeout + 60)

    async def _cancel_all(self, t: Transport, host: HostSpec, actions: list[protocol.ShardAction],
                          wait: float) -> list[protocol.ActResult]:
        """The run's stop: every task of the run, and any task of its name, in one request."""
        timeout = max(actions[0].grace, 60.0) if wait else 1.0
        r = await deploy.run_worker_module(t, self.config, host, self.module, *self.options(), "cancel-all",
                                           "--run-dir", self.config.run_dir(host), "--job-name",
                                           self.config.job_name, "--timeout", str(timeout),
                                           reply=protocol.Cancellation, timeout=timeout + 60)
        if r.error is not None:
            return [protocol.ActResult(shard=a.shard, status="error", detail=r.error) for a in actions]
        return [protocol.ActResult(shard=a.shard, status=r.shards.get(str(a.shard), "not running")) for a in actions]

    async def _submit(self, t: Transport, host: HostSpec, places: list[Placement], num_shards: int,
                      by: str) -> dict[int, protocol.ActResult]:
        """One request for these shards; a shard the submission never reached (the engine did not
        answer) is an error result (its launch failed without a record)."""
        spec = self.submission(host, places, num_shards, by)
        result = await deploy.run_worker_module(t, self.config, host, self.module, *self.options(), "submit",
                                                "--run-dir", self.config.run_dir(host),
                                                input=json.dumps(spec).encode(),
                                                reply=protocol.Submission, timeout=180)
        states = result.shards
        out = {}
        for p in places:
            state = states.get(str(p.shard))            # submitted | refused (recorded) | held (live)
            detail = (f"as job {result.job}" if state == "submitted" and result.job
                      else result.error or (None if state else "submission failed"))
            out[p.shard] = protocol.ActResult(
                shard=p.shard, status={"held": "running"}.get(state, state) if state else "error", detail=detail)
        return out

    def agent_args(self) -> list[str]:
        return ["--engine", str(self.kind), "--engine-options", json.dumps(self.spec.host_options()),
                "--engine-interval", str(self.spec.poll_interval)]


def task_status(record: ShardRecord, live: protocol.TaskState | None) -> TaskStatus | None:
    """A shard's task: the engine's live word (`protocol.TaskState`, for this launch) or what its
    record says (the task, its final state)."""
    a = record.attempt
    if a is None or not a.queued:
        return None
    if live is not None and live.launch == a.n:
        return TaskStatus(job=live.job, phase=live.phase, state=live.state, reason=live.reason,
                          node=live.node or a.node)
    end = a.task_end
    return TaskStatus(job=a.job, phase="ended" if end else None, state=end.state if end else None,
                      reason=end.reason if end else None, node=a.node)


def task_nodes(login: Host, tasks: list[tuple[str, protocol.TaskGpus | None]]) -> dict[str, Host]:
    """One host per node the shards run or ran on: GPUs are the live tasks' own readings there
    (`protocol.TaskGpus`), merged by index; reachable as the login node is."""
    nodes: dict[str, Host] = {}
    for node, reading in tasks:
        h = nodes.get(node)
        if h is None:
            h = nodes[node] = Host(node, node, reachable=login.reachable, clock_offset=login.clock_offset,
                                   last_seen=login.last_seen, replayed=login.replayed, role="node")
        if reading is None:
            continue
        if h.telemetry in (None, "none"):
            h.telemetry = reading.source
        known = {g.index for g in h.gpus}
        h.gpus = sorted(h.gpus + [Gpu(**g.to_dict()) for g in reading.gpus if g.index not in known],
                        key=lambda g: g.index)
        h.gpu_t = reading.t if h.gpu_t is None else min(h.gpu_t, reading.t)
    return nodes
