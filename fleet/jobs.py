"""The command each shard runs: the built-in worker, or a custom template from [job].

Commands are argv lists from start to end. A custom template is split with shlex first and each
token formatted on its own, so a placeholder's value stays one argument whatever it holds.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

from worker import protocol

from .config import Config, HostSpec

AGENT_SENTINEL_KEYS = ("done", "fail", "progress", "progress_glob", "total")


@dataclass(frozen=True)
class Placement:
    shard: int
    host: str
    gpu: int                       # the first of its GPUs (the one a shard of one GPU has)
    gpus: tuple[int, ...] = ()     # all of them, when the shard spans several (gpus_per_shard)

    @property
    def all_gpus(self) -> tuple[int, ...]:
        return self.gpus or (self.gpu,)


@dataclass
class ShardCommand:
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    rows: dict | None = None       # a [job] taking {start}/{end}: its protocol.RowShare (worker/ranged.py)


def place_shards(config: Config, gpus_by_host: dict[str, list[int]]) -> list[Placement]:
    """One shard per `gpus_per_shard` GPUs of a host (in its GPU order), numbered in fleet.toml's
    host order; GPUs left over (fewer than gpus_per_shard) run nothing. With [slurm]: one shard per
    array task, `shards` of them; its GPUs are the task's own (0..k-1 of what Slurm gives it)."""
    k = config.run.gpus_per_shard
    if config.slurm is not None:
        return [Placement(n, config.hosts[0].name, 0, tuple(range(k)) if k > 1 else ())
                for n in range(config.slurm.shards)]
    out = []
    for host in config.hosts:
        gpus = gpus_by_host[host.name]
        for i in range(0, len(gpus) - k + 1, k):
            group = tuple(gpus[i:i + k])
            out.append(Placement(len(out), host.name, group[0], group if k > 1 else ()))
    return out


def shard_dir(config: Config, host: HostSpec, shard: int) -> str:
    return os.path.join(config.run_dir(host), "shards", str(shard))


def shard_command(config: Config, host: HostSpec, place: Placement, num_shards: int,
                  pool: list[int] | tuple[int, ...] = ()) -> ShardCommand:
    """The shard's command line and environment; `pool`: the shards of its host that share their
    rows with it (the built-in worker's --pool; a [job]'s runner when its command takes its rows,
    `{start}`/`{end}`, which the runner fills in for each chunk; any other [job] keeps its shard)."""
    run = config.run
    python = config.python(host)
    values = {"python": python, "shard": place.shard, "num_shards": num_shards, "gpu": place.gpu,
              "gpus": ",".join(map(str, place.all_gpus)),
              "host": host.name, "run": run.name, "output": config.output_dir(host),
              "model": config.host_path(host, run.model) if run.model else "",
              "data": config.host_path(host, run.data) if run.data else "",
              "shard_dir": shard_dir(config, host, place.shard)}
    gpus = {} if config.slurm is not None else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, place.all_gpus))}
    env = {**gpus, "PYTHONUNBUFFERED": "1", **run.env}      # under Slurm, Slurm sets CUDA_VISIBLE_DEVICES
    job = config.spec.job
    if job is not None:
        argv = [token.format(**values, start="{start}", end="{end}") for token in shlex.split(job.command)]
        cwd = config.host_path(host, job.cwd) if job.cwd else None
        rows = protocol.RowShare(num_rows=job.rows, num_shards=num_shards,
                                 min_chunk=job.min_chunk or max(1, job.rows // num_shards // 100),
                                 pool=sorted(pool) if len(pool) > 1 else None).to_dict() if job.rows else None
        return ShardCommand(argv, env, cwd, rows)
    if "PYTHONPATH" in env:          # the user's own paths, after the deployed worker (not instead)
        from .deploy import code_dir
        env["PYTHONPATH"] = f"{code_dir(config, host)}:{env['PYTHONPATH']}"
    argv = [python, "-m", "worker.extract", "--model", values["model"], "--data", values["data"],
            "--out", values["output"], *[a for f in config.output_dirs(host)[1:] for a in ("--spill", f)],
            "--state", values["shard_dir"],
            "--shard-index", str(place.shard), "--num-shards", str(num_shards),
            *(["--pool", ",".join(map(str, sorted(pool)))] if len(pool) > 1 else []),
            "--max-tokens-per-batch", str(run.max_tokens_per_batch), "--too-long", run.too_long]
    if len(place.all_gpus) > 1:
        argv += ["--gpus-per-shard", str(len(place.all_gpus))]
    if run.destination is not None:            # keep_local is the host's: each shard keeps its share
        argv += ["--destination", config.destination(host)]
        if run.keep_local is not None:
            argv += ["--keep-local", str(run.keep_local // max(1, len(pool)))]
    argv += output_args(run) + ["--plan", os.path.join(config.run_dir(host), "plan.json"),
                                "--max-skip-fraction", str(run.max_skip_fraction),
                                "--compile", run.compile,
                                "--cache-dir", os.path.join(config.host_path(host, host.root), "cache")]
    if run.last_layer_norm:
        argv += ["--last-layer-norm", run.last_layer_norm]
    if run.max_length:
        argv += ["--max-length", str(run.max_length)]
    if run.device == "cpu":
        argv += ["--device", "cpu"]
    elif run.device == "cuda":
        argv += ["--device", "cuda:0"]
    return ShardCommand(argv + list(run.extra_args), env, None)


def output_args(run) -> list[str]:
    """What the worker writes: format, layers (default: the format's own preset), loss mask, dtype.
    The worker's preflight takes the same flags, so both resolve layers alike."""
    argv = ["--format", run.format, "--loss-mask", run.loss_mask, "--dtype", run.dtype]
    if run.layers_arg is not None:
        argv += ["--layers", run.layers_arg]
    if run.target_last_hidden_states:
        argv.append("--target-last-hidden-states")
    return argv


def sentinel_spec(config: Config, host: HostSpec) -> dict | None:
    """What the agent needs to supervise a custom job through its log and output files."""
    job = config.spec.job
    if job is None:
        return None
    spec = {k: getattr(job, k) for k in AGENT_SENTINEL_KEYS if getattr(job, k) is not None}
    if "progress_glob" in spec:
        spec["progress_glob"] = config.host_path(host, spec["progress_glob"])
    return spec
