"""What the run's supervisor does before it supervises: deploy and preflight every host that
answers, project the output against their disks, then settle the run's plan (the one the hosts
hold if fleet.toml still agrees with it) and give it to every host. Every line it prints goes
through `say`, so the supervisor can hand it to whichever client started it.

No host locks anyone out (issue 52): a host that does not answer is left out of setup, not the
run — its shards are UNKNOWN until it answers, when it is deployed and preflighted like the others
were (`preflight_late`), and after `host_lost_after` its rows go to the others. A host the plan
has that fleet.toml no longer lists is said once and treated as lost from the start. What stops a
setup (`SetupRefused`, with the exit code the command gives): a preflight refusal, a plan that
disagrees, or no host answering at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Awaitable, Callable

from worker.identity import differences
from worker.protocol import Plan

from . import deploy
from .config import Config
from .footprint import describe, disk_warnings, gb, needs, shipping_lines, verdicts
from .plan import PlanError, layout, make_plan, plan_differences, refusal, removed_hosts, shared_gpus, without_hosts
from .transport import HostError, HostUnusable

if TYPE_CHECKING:
    from .follow import HostLink
    from .engine import Launcher

EXIT_FAULT, EXIT_CONFIG, EXIT_UNREACHABLE = 1, 2, 3
Say = Callable[[str], None]


class SetupRefused(Exception):
    """The run cannot be supervised as fleet.toml says: one line, and the command's exit code."""

    def __init__(self, message: str, code: int = EXIT_FAULT):
        super().__init__(message)
        self.code = code


async def prepare(links: dict[str, HostLink], config: Config, engine: Launcher, say: Say,
                  step: Say, live: Callable[[], Awaitable[list[str]]], replan: bool = False,
                  allow_partial: bool = False, width: int | None = None) -> Plan:
    """Deploy and preflight every host, check the output fits, settle the run's plan; the hosts
    that did not answer are marked for a preflight when they do. Raises SetupRefused."""
    say(f"deploying to {len(config.hosts)} host(s)…")
    results, failures = await deploy_all(links, config, engine, step)
    unreachable = {h: e for h, e in failures.items() if not isinstance(e, HostUnusable)}
    groups = output_needs(config, results, setup_places(engine, config, results, replan))
    say(deploy.format_preflight(results, failures, {h: g.need for g in groups for h in g.hosts}, width=width))
    refusals = output_verdicts(config, results, groups, allow_partial, say)
    if not results and unreachable:
        raise SetupRefused(f"{len(unreachable)} host(s) unreachable: " +
                           "; ".join(map(str, unreachable.values())), EXIT_UNREACHABLE)
    errors = [str(e) for h, e in failures.items() if h not in unreachable] + \
        [f"{r.host}: {e}" for r in results for e in r.errors]
    if errors or refusals:
        raise SetupRefused("preflight refused: " + "; ".join(errors + refusals))
    try:
        plan = await settle_plan(links, config, engine, results, say, live, replan, unreached=sorted(unreachable))
    except PlanError as e:
        raise SetupRefused(str(e)) from None
    for name, why in unreachable.items():
        links[name].unprepared = True
        say(f"{name}: unreachable ({str(why).removeprefix(name + ': ')}): supervising the others; its shards are "
            f"UNKNOWN until it answers (deployed and preflighted then)" + _lost_words(config))
    return plan


def _lost_words(config: Config) -> str:
    after = config.spec.supervise.host_lost_after
    return f", and after {after:g}s its rows go to the others" if after is not None else \
        " (host_lost_after = never: its rows wait for it)"


async def deploy_all(links: dict[str, HostLink], config: Config, engine: Launcher,
                     step: Say) -> tuple[list[deploy.Preflight], dict[str, HostError]]:
    """Upload and preflight every host in parallel; returns results and the hosts that failed
    (HostUnusable: reachable but unable to run the worker; other HostErrors: unreachable)."""
    for link in links.values():
        link.host.trying()
    results = await asyncio.gather(
        *(deploy.deploy_host(l.transport, config, l.spec, engine, step) for l in links.values()),
        return_exceptions=True)
    ok, failures = [], {}
    for link, r in zip(links.values(), results):
        if isinstance(r, HostError):
            failures[link.name] = r
            link.host.down(r)
        elif isinstance(r, BaseException):
            raise r
        else:
            ok.append(r)
            link.host.up()
    return ok, failures


def setup_places(engine: Launcher, config: Config, results: list, replan: bool) -> list:
    """The shard layout the run will use: the plan the hosts hold (unless --replan), else the one
    fleet.toml makes now."""
    held = [r.plan for r in results if r.plan]
    if held and not replan:
        return engine.placements(max(held, key=lambda p: p.created))
    return engine.place({h.name: [] for h in config.hosts} | {r.host: r.gpus for r in results})


def output_needs(config: Config, results: list, places: list) -> list:
    """What each output folder must hold for its hosts' shards, placed as `places`."""
    by_host: dict[str, list[int]] = {}
    for p in places:
        by_host.setdefault(p.host, []).append(p.shard)
    outputs = {h.name: config.output_dir(h) for h in config.hosts}
    return needs({r.host: r.report for r in results}, outputs, by_host, len(places), config.run.keep_local)


def output_verdicts(config: Config, results: list, groups: list, allow_partial: bool, say: Say) -> list[str]:
    """Say the whole run's projection (and where it ships) and the warnings; return the refusals."""
    fp = next((r.report.footprint for r in results if r.report.footprint), None)
    refusals, warnings = verdicts(groups, allow_partial)
    if fp:
        say(describe(fp))
        rates = {r.host: r.report.write_bps for r in results if r.report.write_bps}
        if rates:
            say("output disks measured: " + ", ".join(f"{h} {gb(b)}/s" for h, b in sorted(rates.items()))
                + " (fsync'd files, 8 at once)")
        warnings += disk_warnings(fp, groups, config.spec.expected.tokens_per_s_per_gpu, rates)
        if config.run.destination is not None:
            line, slow = shipping_lines(fp, config.run.destination, config.run.keep_local, groups,
                                        config.spec.expected.tokens_per_s_per_gpu,
                                        {r.host: r.report.uplink_bps for r in results})
            say(line)
            warnings += slow
    for w in warnings:
        say(f"warning: {w}")
    return refusals


def unreached_gpus(config: Config, existing: Plan | None, unreached: list[str]) -> dict[str, list[int]]:
    """The GPUs of hosts that did not answer, for placing the plan without them: the run's plan's
    where it has them, else fleet.toml's list. A new run cannot guess a host's GPUs: PlanError."""
    out: dict[str, list[int]] = {}
    held = layout(existing) if existing is not None else {}
    specs = {h.name: h for h in config.hosts}
    for name in unreached:
        if name in held:
            out[name] = held[name]
        elif (listed := specs[name].gpus) != "all":
            out[name] = list(listed)
        else:
            raise PlanError(f"a new run's plan needs {name}'s GPUs and {name} is unreachable: list them in "
                            f"fleet.toml (gpus = [0, 1, ...]) to start without it, or start when it answers")
    return out


async def settle_plan(links: dict[str, HostLink], config: Config, engine: Launcher, results: list[deploy.Preflight],
                      say: Say, live: Callable[[], Awaitable[list[str]]], replan: bool = False,
                      unreached: Sequence[str] = ()) -> Plan:
    """The run's plan after deploy: the one the hosts hold if fleet.toml still agrees with it,
    else a refusal (PlanError) naming the differences — or, with `replan` and nothing live, a
    new one. Every host that answered gets the plan that is used; a host the plan has that
    fleet.toml no longer lists keeps its shards in it, and its rows go to the others."""
    base = results[0]
    for r in results[1:]:
        diffs = differences(base.identity, r.identity)
        if diffs:
            raise PlanError(f"{r.host}'s model or data differs from {base.host}'s: " + "; ".join(diffs))
    if clashes := shared_gpus([(r.host, r.report.host_id, r.gpus, r.report.gpu_uuids) for r in results]):
        raise PlanError("; ".join(clashes))
    held = [r.plan for r in results if r.plan]
    existing = max(held, key=lambda p: p.created) if held else None
    gpus = unreached_gpus(config, None if replan else existing, list(unreached)) | {r.host: r.gpus for r in results}
    desired = make_plan(config, engine.place(gpus), engine.kind, base.identity,
                        {r.host: r.report.host_id for r in results})
    plan, replaced = desired, False
    if existing is not None:
        removed = [] if replan else removed_hosts(existing, config)
        diffs = plan_differences(without_hosts(existing, removed), desired, layout_differences=engine.layout_differences)
        if not diffs:
            plan = existing
            for name in removed:
                shards = ", ".join(str(s.id) for s in existing.shards if s.host == name)
                rows = ("its rows go to the other hosts now, as a lost host's (those it finished are done again)"
                        if config.spec.supervise.host_lost_after is not None else
                        "its rows stay its own (host_lost_after = never): restore it in fleet.toml to finish them")
                say(f"{name}: no longer in fleet.toml, but the run's plan has shards {shards} there: {rows}; "
                    f"what {name} still does is not counted (`fleet down` before taking a host out stops it)")
        elif not replan:
            raise PlanError(refusal(existing, diffs))
        else:
            if running := await live():
                raise PlanError(f"--replan needs every shard stopped; live: {', '.join(running)} (fleet down first)")
            say("replanned: " + "; ".join(diffs))
            replaced = True
    await asyncio.gather(*(write_plan(config, links[r.host], plan, replaced) for r in results if r.plan != plan))
    return plan


async def write_plan(config: Config, link: HostLink, plan: Plan, replaced: bool) -> None:
    argv = await deploy.worker_argv(link.transport, config, link.spec, "plan", "write",
                                    "--run-dir", config.run_dir(link.spec),
                                    *(["--archive-records"] if replaced else []))
    r = await link.transport.run(argv, timeout=60, input=plan.to_json().encode())
    if r.rc != 0:
        raise PlanError(f"{link.name}: cannot write the run's plan: {deploy.last_line(r.stderr)}")


async def preflight_late(link: HostLink, config: Config, engine: Launcher, plan: Plan, say: Say,
                         allow_partial: bool = False) -> None:
    """A host that did not answer during setup answers now: deploy and preflight it as setup
    would have, check it against the run's plan (its model and data, its GPUs, its disk), give it
    the plan. Raises HostUnusable naming what it lacks: the host is then unusable (its rows go to
    the others after host_lost_after) and tried again later."""
    say(f"{link.name}: answered: deploying and preflighting it")
    result = await deploy.deploy_host(link.transport, config, link.spec, engine, say)
    problems = list(result.errors)
    problems += [f"its model or data differs from the plan's: {d}" for d in differences(plan.identity, result.identity)]
    planned = layout(plan).get(link.name, [])
    if missing := sorted(set(planned) - set(result.gpus)):
        problems.append(f"the plan runs shards on its GPUs {planned}; it has {result.gpus or 'none'} "
                        f"(missing {missing})")
    refusals, _ = verdicts(output_needs(config, [result], engine.placements(plan)), allow_partial)
    problems += refusals
    if problems:
        raise HostUnusable(f"{link.name}: preflight refused: " + "; ".join(problems))
    if result.plan != plan:
        await write_plan(config, link, plan, replaced=False)
    say(f"{link.name}: preflight ok ({len(result.gpus)} GPU(s)); supervising it")
