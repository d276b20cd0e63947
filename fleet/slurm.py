"""Slurm as the launcher, the supervisor's side: what a submission asks of `sbatch`, and the
submission itself (one array task per shard: its argv, environment and sentinels), which
`python -m worker.slurm submit` on the login node records and submits. Pure: no I/O.
"""

from __future__ import annotations

from .config import Config, HostSpec, SlurmSpec
from .deploy import code_dir
from .jobs import Placement, sentinel_spec, shard_command


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
        tasks[str(place.shard)] = {"argv": cmd.argv, "env": cmd.env, "cwd": cmd.cwd,
                                   "sentinels": sentinel_spec(config, host), "rows": cmd.rows}
    return {"job_name": config.job_name, "by": by, "sbatch": sbatch_options(spec, config.run.gpus_per_shard),
            "max_parallel": spec.max_parallel, "python": config.python(host),
            "pythonpath": code_dir(config, host), "tasks": tasks}
