"""`[ray]`: one Ray actor per shard on a Ray cluster, created and watched from a node of it
(`python -m worker.engine.ray`, which also translates Ray's actor states). The actors share the
run's rows through the ledger in the run's folder, as a host's GPUs do: a lost node's rows are taken
by the other actors, and the lost actors are placed again by Ray when the restart policy launches
them. The run's folder (`root`) must be one every node sees.
"""

from __future__ import annotations

from .tasks import TaskLauncher


class RayLauncher(TaskLauncher):
    kind = "ray"
    label = "Ray"
    shares_rows = True

    def engine_request(self) -> dict:
        spec = self.config.ray
        assert spec is not None
        gpus = self.config.run.gpus_per_shard if spec.num_gpus is None else spec.num_gpus
        return {"ray": {"num_gpus": gpus, "num_cpus": spec.num_cpus, "resources": spec.resources,
                        "runtime_env": spec.runtime_env}}
