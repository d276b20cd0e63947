"""What `fleet up` does before it supervises: deploy and preflight every host, then settle the
run's plan (the one the hosts hold if fleet.toml still agrees with it) and give it to every host.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from worker.identity import differences
from worker.protocol import Plan

from . import deploy
from .follow import HostLink
from .plan import PlanError, make_plan, plan_differences, refusal, shared_gpus
from .transport import HostError

if TYPE_CHECKING:
    from .supervisor import Supervisor


async def deploy_all(sup: Supervisor) -> tuple[list[deploy.Preflight], dict[str, HostError]]:
    """Upload and preflight every host in parallel; returns results and the hosts that failed
    (HostUnusable: reachable but unable to run the worker; other HostErrors: unreachable)."""
    for host in sup.store.hosts.values():
        host.trying()
    results = await asyncio.gather(
        *(deploy.deploy_host(l.transport, sup.config, l.spec, sup.launcher, sup.on_log) for l in sup.links.values()),
        return_exceptions=True)
    ok, failures = [], {}
    for link, r in zip(sup.links.values(), results):
        if isinstance(r, HostError):
            failures[link.name] = r
            link.host.down(r)
        elif isinstance(r, BaseException):
            raise r
        else:
            ok.append(r)
            link.host.up()
    return ok, failures


async def settle_plan(sup: Supervisor, results: list[deploy.Preflight], replan: bool = False) -> Plan:
    """The run's plan after deploy: the one the hosts hold if fleet.toml still agrees with it,
    else a refusal (PlanError) naming the differences — or, with `replan` and nothing live, a
    new one. Every host gets the plan that is used."""
    base = results[0]
    for r in results[1:]:
        diffs = differences(base.identity, r.identity)
        if diffs:
            raise PlanError(f"{r.host}'s model or data differs from {base.host}'s: " + "; ".join(diffs))
    engine = sup.launcher
    if clashes := shared_gpus([(r.host, r.report.host_id, r.gpus, r.report.gpu_uuids) for r in results]):
        raise PlanError("; ".join(clashes))
    desired = make_plan(sup.config, engine.place({r.host: r.gpus for r in results}), engine.kind, base.identity,
                        {r.host: r.report.host_id for r in results})
    held = [r.plan for r in results if r.plan]
    existing = max(held, key=lambda p: p.created) if held else None
    plan, replaced = desired, False
    if existing is not None:
        diffs = plan_differences(existing, desired, layout_differences=engine.layout_differences)
        if not diffs:
            plan = existing
        elif not replan:
            raise PlanError(refusal(existing, diffs))
        else:
            live = await live_shards(sup)
            if live:
                raise PlanError(f"--replan needs every shard stopped; live: {', '.join(live)} (fleet down first)")
            sup.on_log("replanned: " + "; ".join(diffs))
            replaced = True
    await asyncio.gather(*(write_plan(sup, sup.links[r.host], plan, replaced) for r in results if r.plan != plan))
    sup.store.use_plan(plan)
    return plan


async def write_plan(sup: Supervisor, link: HostLink, plan: Plan, replaced: bool) -> None:
    argv = await deploy.worker_argv(link.transport, sup.config, link.spec, "plan", "write",
                                    "--run-dir", sup.config.run_dir(link.spec),
                                    *(["--archive-records"] if replaced else []))
    r = await link.transport.run(argv, timeout=60, input=plan.to_json().encode())
    if r.rc != 0:
        raise PlanError(f"{link.name}: cannot write the run's plan: {deploy.last_line(r.stderr)}")


async def live_shards(sup: Supervisor) -> list[str]:
    """'id (host:gpu)' of every shard whose process is alive, on every reachable host."""
    from .supervisor import Supervisor
    async with Supervisor(sup.config) as probe:
        snap = await probe.read_once()
    return [f"{s.id} ({s.host}:{s.gpu})" for s in snap.shards if s.alive]
