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
    """Where a shard runs, as its engine (fleet/engine/) placed it."""
    shard: int
    host: str
    gpu: int                       # the first of its GPUs (the one a shard of one GPU has)
    gpus: tuple[int, ...] = ()     # all of them, when the shard spans several (gpus_per_shard)
    pinned: bool = True            # given these GPUs by fleet (False: by its engine of tasks)

    @property
    def all_gpus(self) -> tuple[int, ...]:
        return self.gpus or (self.gpu,)

    def gpu_env(self) -> dict[str, str]:
        """The environment that gives the shard its GPUs (none where its engine does)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, self.all_gpus))} if self.pinned else {}


@dataclass
class ShardCommand:
    argv: list[str]
    env: dict[str, str]
    cwd: str | None
    rows: protocol.RowShare | None = None   # a [job] taking {start}/{end}: its share (worker/ranged.py)


def shard_dir(config: Config, host: HostSpec, shard: int) -> str:
    return os.path.join(config.run_dir(host), "shards", str(shard))


def shard_command(config: Config, host: HostSpec, place: Placement, num_shards: int,
                  pool: list[int] | tuple[int, ...] = ()) -> ShardCommand:
    """The shard's command line and environment; `pool`: the shards of its host that share their
    rows with it (the built-in worker's --pool; a [job]'s runner when its command takes its rows,
    `{start}`/`{end}`, which the runner fills in for each chunk; any other [job] keeps its shard)."""
    run = config.run
    python = config.python(host)
    output = config.output_dir(host)
    model = config.host_path(host, run.model) if run.model else ""
    data = config.host_path(host, run.data) if run.data else ""
    state_dir = shard_dir(config, host, place.shard)
    values = {"python": python, "shard": place.shard, "num_shards": num_shards, "gpu": place.gpu,
              "gpus": ",".join(map(str, place.all_gpus)),
              "host": host.name, "run": run.name, "output": output, "model": model, "data": data,
              "shard_dir": state_dir}
    env = {**place.gpu_env(), "PYTHONUNBUFFERED": "1", **run.env}
    job = config.spec.job
    if job is not None:
        argv = [token.format(**values, start="{start}", end="{end}") for token in shlex.split(job.command)]
        cwd = config.host_path(host, job.cwd) if job.cwd else None
        rows = protocol.RowShare(num_rows=job.rows, num_shards=num_shards,
                                 min_chunk=job.min_chunk or max(1, job.rows // num_shards // 100),
                                 pool=sorted(pool) if len(pool) > 1 else None) if job.rows else None
        return ShardCommand(argv, env, cwd, rows)
    if "PYTHONPATH" in env:          # the user's own paths, after the deployed worker (not instead)
        from .bundle import code_dir
        env["PYTHONPATH"] = f"{code_dir(config, host)}:{env['PYTHONPATH']}"
    argv = [python, "-m", "worker.extract", "--model", model, "--data", data,
            "--out", output, *[a for f in config.output_dirs(host)[1:] for a in ("--spill", f)],
            "--state", state_dir,
            "--shard-index", str(place.shard), "--num-shards", str(num_shards),
            *(["--pool", ",".join(map(str, sorted(pool)))] if len(pool) > 1 else []),
            "--max-tokens-per-batch", str(run.max_tokens_per_batch), "--too-long", run.too_long]
    if len(place.all_gpus) > 1:
        argv += ["--gpus-per-shard", str(len(place.all_gpus))]
    destination = config.destination(host)     # (None when run.destination is)
    if destination is not None:                # keep_local is the host's: each shard keeps its share
        argv += ["--destination", destination]
        if run.keep_local is not None:
            argv += ["--keep-local", str(run.keep_local // max(1, len(pool)))]
    argv += output_args(run) + ["--plan", os.path.join(config.run_dir(host), "plan.json"),
                                "--max-skip-fraction", str(run.max_skip_fraction),
                                "--reference-checks", "0" if run.reference_checks == "off" else str(run.reference_checks),
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


def sentinel_spec(config: Config, host: HostSpec) -> protocol.SentinelSpec | None:
    """What the agent needs to supervise a custom job through its log and output files."""
    job = config.spec.job
    if job is None:
        return None
    spec = {k: getattr(job, k) for k in AGENT_SENTINEL_KEYS if getattr(job, k) is not None}
    if "progress_glob" in spec:
        spec["progress_glob"] = config.host_path(host, spec["progress_glob"])
    return protocol.SentinelSpec(**spec)
