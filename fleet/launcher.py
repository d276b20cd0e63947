"""Who starts and stops shards: one Launcher per engine, chosen once from fleet.toml.

Both engines take the same typed actions (`protocol.ShardAction`: launch, stop, restart) and answer
with `protocol.ActResult`s; the outcome itself (the launch, the end) is read from the shard's record
by the agent, never from how long a command took. The Supervisor keeps the loop and the records and
calls only this interface; it never asks which engine it has.

- `HostLauncher`: `[[hosts]]`. A host's actions go in one `python -m worker.hostctl act` (typed JSON
  lines on stdin): launches of eight shards are one SSH command and one Python start, and every stop
  and restart is carried out on the host by the one door there (intent recorded, group signalled,
  escalated, confirmed gone, then the launch).
- `SlurmLauncher`: `[slurm]`. Launches (and restarts of ended tasks) are one `sbatch --array` through
  `worker.slurm submit`; stops and restarts of live tasks are `worker.slurm cancel` with the same
  intent in the record; the supervisor resubmits once the cancelled task's end is recorded.
"""

from __future__ import annotations

import json
from typing import Protocol

from worker import protocol

from . import deploy
from . import slurm as slurm_submission
from .config import Config, HostSpec
from .jobs import Placement, sentinel_spec, shard_command, shard_dir
from .transport import HostUnusable, Transport

ACT_TIMEOUT_S = 60.0          # one host's act command (it only records, signals and spawns)


class Launcher(Protocol):
    async def act(self, t: Transport, host: HostSpec, actions: list[protocol.ShardAction],
                  places: dict[int, Placement], num_shards: int,
                  wait: float = 0.0) -> list[protocol.ActResult]: ...

    def log_argv(self, host: HostSpec, shard: int, last: int, follow: bool) -> list[str]: ...

    def agent_args(self) -> list[str]:
        """What the host agent is told about the engine (Slurm: liveness from squeue)."""


def make_launcher(config: Config) -> Launcher:
    return SlurmLauncher(config) if config.slurm is not None else HostLauncher(config)


class _Engine:
    """What both engines share: the config, and a shard's log read in place on the host."""

    def __init__(self, config: Config):
        self.config = config

    def log_argv(self, host: HostSpec, shard: int, last: int, follow: bool) -> list[str]:
        # -F follows across the log's creation; tail's own chatter is dropped by the reader.
        return ["tail", "-q", "-n", str(last)] + (["-F"] if follow else []) + \
            [f"{shard_dir(self.config, host, shard)}/log"]


class HostLauncher(_Engine):

    def launch_spec(self, host: HostSpec, place: Placement, num_shards: int, pool: list[int]) -> dict:
        """`pool`: the host's shards, which share their rows (worker/leases.py): a host's GPUs
        finish a dead one's rows without a supervisor."""
        cmd = shard_command(self.config, host, place, num_shards, pool)
        return {"argv": cmd.argv, "env": cmd.env, "cwd": cmd.cwd, "gpu": place.gpu,
                "sentinels": sentinel_spec(self.config, host), "rows": cmd.rows}

    async def act(self, t: Transport, host: HostSpec, actions: list[protocol.ShardAction],
                  places: dict[int, Placement], num_shards: int,
                  wait: float = 0.0) -> list[protocol.ActResult]:
        """Raises HostError when the command could not run (the host is unreachable, or hostctl
        itself failed there: HostUnusable)."""
        for a in actions:
            if a.kind != "stop" and a.launch_spec is None:
                a.launch_spec = self.launch_spec(host, places[a.shard], num_shards, sorted(places))
        argv = ["act", "--run-dir", self.config.run_dir(host)] + (["--wait", str(wait)] if wait else [])
        text = "".join(a.to_json() + "\n" for a in actions)
        r = await t.run(await deploy.worker_argv(t, self.config, host, "hostctl", *argv),
                        timeout=ACT_TIMEOUT_S + wait, input=text.encode())
        if r.rc != 0:
            raise HostUnusable(deploy._python_missing(self.config, host, r.stderr) or
                                      f"{host.name}: worker.hostctl failed (exit {r.rc}): "
                                      f"{deploy.last_line(r.stderr)}")
        results = []
        for line in r.stdout.splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if isinstance(d, dict) and d.get(protocol.ActResult.TAG) == protocol.ActResult.KIND:
                results.append(protocol.ActResult.from_dict(d))
        return results


    def agent_args(self) -> list[str]:
        return []


class SlurmLauncher(_Engine):

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
        spec = slurm_submission.submission(self.config, host, places, num_shards, by)
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

