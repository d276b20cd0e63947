"""`[slurm]`: one array task per shard, submitted with `sbatch --array` from the login node
(`python -m worker.engine.slurm`, which also translates Slurm's states). A shard's rows stay its
own: Slurm's nodes share only a network filesystem, where flocks are not reliably seen across nodes.
"""

from __future__ import annotations

from ..config import SlurmSpec
from .tasks import TaskLauncher


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


class SlurmLauncher(TaskLauncher):
    kind = "slurm"
    label = "Slurm"

    def engine_request(self) -> dict:
        spec = self.config.slurm
        assert spec is not None
        return {"sbatch": sbatch_options(spec, self.config.run.gpus_per_shard), "max_parallel": spec.max_parallel}
