"""Slurm as the launcher, the supervisor's side (the engine's one file): `SlurmLauncher`, what a
submission asks of `sbatch`, the submission itself (one array task per shard: its argv, environment
and sentinels), which `python -m worker.slurm submit` on the login node records and submits, and
where a shard runs (the node and GPUs its task got) as the snapshot shows it.

With `[slurm]` the one host fleet talks to is the login node; a shard is an array task, placed by
Slurm (its GPUs 0..k-1 of the task's allocation, which Slurm sets in CUDA_VISIBLE_DEVICES), and
its rows stay its own (the nodes share only a network file system, where flocks are not reliably
seen across nodes).
"""

from __future__ import annotations

import json

from worker import protocol

from . import deploy
from .config import Config, HostSpec, SlurmSpec
from .bundle import code_dir
from .jobs import Placement, sentinel_spec, shard_command
from .launcher import _Engine
from .record import ShardRecord
from .schema import Gpu, SlurmTaskStatus
from .snapshot import ShardView
from .hosts import Host
from .store import Shard, Store
from .transport import Transport


def sbatch_options(spec: SlurmSpec, gpus_per_shard: int = 1) -> list[str]:
    """[slurm]'s keys as sbatch options; the user's `sbatch_args` last (they may refine them). A
    task asks for its shard's GPUs (`gpus_per_task`, by default [run] gpus_per_shard)."""
    out = []
    if spec.partition:
        out.append(f"--partition={spec.partition}")
    if spec.account:
        out.append(f"--account={spec.account}")
    if spec.time:
        out.append(f"--time={spec.time}")
    gpus = gpus_per_shard if spec.gpus_per_task is None else spec.gpus_per_task
    if gpus:
        out.append(f"--gres=gpu:{gpus}")
    return out + list(spec.sbatch_args)


def submission(config: Config, host: HostSpec, places: list[Placement], num_shards: int, by: str) -> dict:
    """What `worker.slurm submit` reads on stdin for these shards."""
    spec = config.slurm
    assert spec is not None
    tasks = {}
    for place in places:
        cmd = shard_command(config, host, place, num_shards)
        tasks[str(place.shard)] = protocol.LaunchSpec(argv=cmd.argv, env=cmd.env, cwd=cmd.cwd,
                                                      sentinels=sentinel_spec(config, host), rows=cmd.rows).to_dict()
    return {"job_name": config.job_name, "by": by, "sbatch": sbatch_options(spec, config.run.gpus_per_shard),
            "max_parallel": spec.max_parallel, "python": config.python(host),
            "pythonpath": code_dir(config, host), "tasks": tasks}


class SlurmLauncher(_Engine):
    kind = "slurm"
    pinned = False

    def place(self, gpus_by_host: dict[str, list[int]]) -> list[Placement]:
        """One shard per array task, `shards` of them; its GPUs are the task's own (0..k-1 of what
        Slurm gives it)."""
        k = self.config.run.gpus_per_shard
        return [Placement(n, self.config.hosts[0].name, 0, tuple(range(k)) if k > 1 else (), pinned=False)
                for n in range(self.config.slurm.shards)]

    @staticmethod
    def layout_differences(old: protocol.Plan, new: protocol.Plan) -> list[str]:
        """Slurm picks the nodes and GPUs: two plans differ only in their shard count."""
        return [f"shards: {old.num_shards} -> {new.num_shards}"] if old.num_shards != new.num_shards else []

    def first_hosts(self) -> dict[str, Host]:
        return {h.name: Host(h.name, self.config.slurm.login, role="login", usd_per_hour=h.usd_per_hour)
                for h in self.config.hosts}

    def view(self, shard: Shard, view: ShardView) -> ShardView:
        """A Slurm shard shows its task, and its node (and the first GPU Slurm gave it) once it started."""
        a = shard.record.attempt
        view.slurm = slurm_task(shard.record, shard.slurm)
        node = (a.node or (view.slurm.node if view.slurm else None)) if a is not None else None
        if node:
            view.node, view.gpu = node, (a.gpus[0] if a.gpus else view.gpu)
            view.gpus = tuple(a.gpus) if a.gpus else view.gpus
        return view

    def nodes(self, store: Store) -> dict[str, Host]:
        """One host per compute node the shards run or ran on, carrying the GPUs their live tasks report."""
        tasks = []
        for s in store.shards.values():
            a = s.record.attempt
            live = slurm_task(s.record, s.slurm) if a is not None else None
            node = (a.node or (live.node if live else None)) if a is not None else None
            if node:
                reporting = s.alive and not a.ended and s.gpus is not None and s.gpus.launch == a.n
                tasks.append((node, s.gpus if reporting else None))
        return slurm_nodes(store.hosts[self.config.hosts[0].name], tasks)

    def preflight_gpus(self, host: HostSpec) -> tuple[str, str]:
        """The login node's GPUs are not the run's: Slurm allocates them."""
        return ",".join(map(str, range(self.config.run.gpus_per_shard))), "cpu"

    async def host_checks(self, t: Transport, host: HostSpec, result: deploy.Preflight) -> str:
        """`worker.slurm check` on the login node: Slurm answers, the partition and account exist."""
        result.gpus = []
        sl, report = self.config.slurm, result.report
        report.slurm = await deploy.run_worker_module(
            t, self.config, host, "slurm", "check", "--shards", str(sl.shards),
            *(["--partition", sl.partition] if sl.partition else []),
            *(["--account", sl.account] if sl.account else []), reply=protocol.SlurmCheck, timeout=120)
        report.checks = report.checks + report.slurm.checks
        return "Slurm allocates the GPUs"

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
                      wait: float) -> protocol.SlurmCancelled:
        timeout = max(a.grace, 60.0)
        args = ["cancel", "--run-dir", self.config.run_dir(host), "--shard", str(a.shard), "--why", a.why,
                "--timeout", str(timeout if wait else 1.0)]
        if a.reason:
            args += ["--reason", a.reason]
        if a.kind == "restart":
            args += ["--then", "launch", "--by", a.by]
        return await deploy.run_worker_module(t, self.config, host, "slurm", *args,
                                              reply=protocol.SlurmCancelled, timeout=timeout + 60)

    async def _cancel_all(self, t: Transport, host: HostSpec, actions: list[protocol.ShardAction],
                          wait: float) -> list[protocol.ActResult]:
        """The run's stop: every task of the run, and any job of its name, in one scancel."""
        timeout = max(actions[0].grace, 60.0) if wait else 1.0
        r = await deploy.run_worker_module(t, self.config, host, "slurm", "cancel-all", "--run-dir",
                                           self.config.run_dir(host), "--job-name", self.config.job_name,
                                           "--timeout", str(timeout), reply=protocol.SlurmCancelled,
                                           timeout=timeout + 60)
        if r.error is not None:
            return [protocol.ActResult(shard=a.shard, status="error", detail=r.error) for a in actions]
        return [protocol.ActResult(shard=a.shard, status=r.shards.get(str(a.shard), "not running")) for a in actions]

    async def _submit(self, t: Transport, host: HostSpec, places: list[Placement], num_shards: int,
                      by: str) -> dict[int, protocol.ActResult]:
        """One array for these shards; a shard the submission never reached (squeue did not answer)
        is an error result (its launch failed without a record)."""
        spec = submission(self.config, host, places, num_shards, by)
        result = await deploy.run_worker_module(t, self.config, host, "slurm", "submit", "--run-dir",
                                                self.config.run_dir(host), input=json.dumps(spec).encode(),
                                                reply=protocol.SlurmSubmitted, timeout=180)
        states = result.shards
        out = {}
        for p in places:
            state = states.get(str(p.shard))            # submitted | refused (recorded) | held (live)
            detail = (f"as job {result.job}" if state == "submitted" and result.job
                      else result.error or (None if state else "submission failed"))
            out[p.shard] = protocol.ActResult(
                shard=p.shard, status={"held": "running"}.get(state, state or "error"), detail=detail)
        return out


    def agent_args(self) -> list[str]:
        return ["--slurm", "--slurm-interval", str(self.config.slurm.poll_interval)]



def slurm_task(record: ShardRecord, live) -> SlurmTaskStatus | None:
    """A Slurm shard's task: Slurm's live word (`protocol.SlurmTask`, for this launch) or what its
    record says (the job, the final state)."""
    a = record.attempt
    if a is None or not a.slurm:
        return None
    if live is not None and live.launch == a.n:
        return SlurmTaskStatus(job=live.job, state=live.state, reason=live.reason, node=live.node or a.node)
    end = a.slurm_end
    return SlurmTaskStatus(job=a.job, state=end.state if end else None, reason=end.reason if end else None,
                           node=a.node)


def slurm_nodes(login: Host, tasks: list[tuple[str, protocol.TaskGpus | None]]) -> dict[str, Host]:
    """One host per compute node the shards run or ran on: GPUs are the live tasks' own readings
    there (`protocol.TaskGpus`), merged by index; reachable as the login node is."""
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
