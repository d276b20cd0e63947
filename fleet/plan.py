"""The run's plan: made once, at the first `fleet up`, from fleet.toml, the GPUs preflight found
and the identity of the work; stored on every host (worker/plan.py) and read back by every command.

Nothing recomputes the shard layout afterwards: `fleet restart 0` launches shard 0 with the plan's
`num_shards` whatever fleet.toml or an unreachable host says now. A fleet.toml that disagrees with
the plan is refused with the differences and the way out (`fleet down`, then `fleet up --replan`,
which keeps every finished sample: output files are named by global index).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

from worker.identity import differences, upgraded
from worker.plan import PLAN_VERSION
from worker.protocol import Plan, PlanShard, WorkIdentity

from .config import Config
from .jobs import Placement

# fleet.toml values that change what is written (the rest: batch size, device, env, telemetry,
# may change between launches). Model and data are compared by identity, not by path.
SPEC_KEYS = ("output", "layers", "last_layer_norm", "target_last_hidden_states", "max_length",
             "too_long", "format", "dtype", "loss_mask", "gpus_per_shard", "extra_args")
# What a key added to [run] after a plan was made meant for that plan (all earlier runs were bf16).
SPEC_DEFAULTS = {"dtype": "bf16", "gpus_per_shard": 1, "extra_args": []}


class PlanError(Exception):
    """fleet.toml and the run's plan disagree; the message lists how and what to do."""


def spec_of(config: Config) -> dict:
    run = config.run
    spec = {key: getattr(run, key) for key in SPEC_KEYS if hasattr(run, key)}
    spec["output"] = {h.name: config.output_dir(h) for h in config.hosts}  # as each host sees it
    spec["job"] = config.spec.job.command if config.spec.job else None
    return spec


def shared_gpus(hosts: list[tuple[str, str | None, list[int], list[str]]]) -> list[str]:
    """Two host names that reach one machine and would give one GPU two shards: the same card
    (its UUID), or the same machine (its host id: one root, one machine) with a GPU index in
    common. `hosts`: (name, host id, GPU indices, GPU UUIDs). One line each."""
    out = []
    for i, (a, a_id, a_gpus, a_uuids) in enumerate(hosts):
        for b, b_id, b_gpus, b_uuids in hosts[i + 1:]:
            cards = sorted(set(a_uuids) & set(b_uuids))
            both = sorted(set(a_gpus) & set(b_gpus))
            if cards or (a_id and a_id == b_id and both):
                which = f"GPU {cards[0]}" if cards else f"GPU {both[0]} (host id {a_id})"
                out.append(f"{a} and {b} are one machine: {which} would run two shards at once; "
                           f"list the machine once, or give each name other GPUs")
    return out


def make_plan(config: Config, places: list[Placement], launcher: str | None, identity: WorkIdentity,
              host_ids: dict[str, str | None] | None = None) -> Plan:
    """The plan of `places` (where the engine, `launcher` by its kind, put the shards; under
    Slurm one array task per shard, gpu the task's first); `host_ids`: each host name's machine
    (its identity file, worker.preflight.host_id)."""
    return Plan(version=PLAN_VERSION, run=config.run.name, created=round(time.time(), 3),
                num_shards=len(places),
                shards=[PlanShard(p.shard, p.host, p.gpu, list(p.all_gpus)) for p in places],
                spec=spec_of(config), identity=identity,
                host_ids={name: i for name, i in (host_ids or {}).items() if i}, launcher=launcher)


def layout(plan: Plan) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for s in plan.shards:
        out.setdefault(s.host, []).extend(s.gpus or [s.gpu])
    return out


def gpu_layout_differences(old: Plan, new: Plan) -> list[str]:
    """Where the shards run, for an engine that gives each shard its host's GPUs: per host."""
    a, b = layout(old), layout(new)
    return [f"gpus of {host}: {a.get(host, 'none')} -> {b.get(host, 'none')}"
            for host in sorted(set(a) | set(b)) if a.get(host) != b.get(host)]


def plan_differences(old: Plan, new: Plan, compare_identity: bool = True,
                     layout_differences: Callable[[Plan, Plan], list[str]] = gpu_layout_differences) -> list[str]:
    """How `new` (from fleet.toml now) differs from `old` (the run's plan), one line each;
    `layout_differences`: how the engine compares where shards run (its Launcher's)."""
    out = []
    if old.launcher != new.launcher:
        out.append(f"launcher: {old.launcher or 'ssh hosts'} -> {new.launcher or 'ssh hosts'}")
    else:
        out += layout_differences(old, new)
    old_ids, new_ids = old.host_ids, new.host_ids
    for host in sorted(set(old_ids) & set(new_ids)):
        if old_ids[host] != new_ids[host]:
            out.append(f"host {host} is another machine: the plan's {host} is {old_ids[host]}, fleet.toml's "
                       f"{host} is {new_ids[host]} (names swapped or an address changed in fleet.toml?)")
    spec = new.spec
    defaults = {key: value for key, value in SPEC_DEFAULTS.items() if key in spec}
    out += differences({**defaults, **old.spec}, spec)
    if compare_identity:
        out += differences(upgraded(old.identity), new.identity)
    return out


def refusal(old: Plan, diffs: list[str]) -> str:
    made = time.strftime("%Y-%m-%d %H:%M", time.localtime(old.created))
    return (f"fleet.toml disagrees with run {old.run}'s plan (made {made}): "
            + "; ".join(diffs) + ". To run the new plan: `fleet down`, then `fleet up --replan` "
            "(finished samples are kept); or restore fleet.toml")


def removed_hosts(plan: Plan, config: Config) -> list[str]:
    """Hosts the run's plan places shards on that fleet.toml no longer lists (none for a plan whose
    shards an engine of tasks places: its one host is the login node): a lost host's from the start,
    their rows go to the others."""
    if plan.launcher is not None:
        return []
    known = {h.name for h in config.hosts}
    return sorted({s.host for s in plan.shards} - known)


def without_hosts(plan: Plan, hosts: list[str]) -> Plan:
    """The plan as if `hosts` were never in it: what fleet.toml, which no longer lists them, is
    compared with (their shards stay in the run's plan, and their rows go to the others)."""
    if not hosts:
        return plan
    gone = set(hosts)
    spec = dict(plan.spec)
    if isinstance(spec.get("output"), dict):
        spec["output"] = {h: o for h, o in spec["output"].items() if h not in gone}
    return replace(plan, shards=[s for s in plan.shards if s.host not in gone], spec=spec,
                   host_ids={h: i for h, i in plan.host_ids.items() if h not in gone})
