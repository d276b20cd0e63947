"""`fleet`: the command line (click). Every command takes -c/--config (default ./fleet.toml).

Exit codes: 0 healthy or done, 1 a shard FAILED/FATAL/STALLED (or verify found a problem, or
the command was refused), 2 a config or usage error (a shard that is not in the run), 3 a host
unreachable.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from typing import Awaitable, Callable

import click

from worker.identity import differences

from worker.formats import FORMATS
from worker.protocol import Plan
from worker.text import runs_text

from . import render, setup
from .actions import describe
from .config import Config, ConfigError, load_config
from .schema import json_schema
from .snapshot import status_exit_code
from .state import SETTLED
from .supervisor import Supervisor
from .plan import PlanError, refusal, spec_of
from .transport import HostError, HostUnusable

EXIT_FAULT, EXIT_CONFIG, EXIT_UNREACHABLE = 1, 2, 3

config_option = click.option("-c", "--config", "config_path", default="fleet.toml", show_default=True,
                             type=click.Path(dir_okay=False), help="the run's fleet.toml")


def fail(message: str, code: int) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def load(path: str) -> Config:
    try:
        return load_config(path)
    except ConfigError as e:
        fail(str(e), EXIT_CONFIG)
        raise                                             # unreachable


def run_async(fn: Callable[[], Awaitable[int]]) -> None:
    try:
        code = asyncio.run(fn())
    except KeyboardInterrupt:
        click.echo("interrupted; workers keep running (fleet status to see them)", err=True)
        code = 130
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fleet")
def main() -> None:
    """Run one hidden-state extraction worker per GPU across a fleet of hosts, and watch it.

    \b
    fleet up            deploy, launch every shard, open the live view
    fleet status        one snapshot (--json for scripts)
    fleet logs SHARD    a shard's log (-f to follow)
    fleet restart SHARD restart a shard (it resumes)
    fleet down          stop every shard
    fleet verify        check the output: every sample once, every file sound
    fleet export        convert the output to another trainer's layout on every host
    """


# --- up ----------------------------------------------------------------------------------------

async def deploy_and_plan(sup: Supervisor, replan: bool = False, allow_partial: bool = False) -> Plan:
    """Deploy and preflight every host, check the output fits, then settle the run's plan; exits
    on any refusal."""
    config = sup.config
    click.echo(f"deploying to {len(config.hosts)} host(s)…", err=True)
    results, failures = await setup.deploy_all(sup)
    from .deploy import format_preflight
    groups = output_needs(sup, results, replan)
    click.echo(format_preflight(results, failures, {h: g.need for g in groups for h in g.hosts},
                                width=shutil.get_terminal_size((120, 24)).columns), err=True)
    refusals = output_verdicts(config, results, groups, allow_partial)
    unreachable = {h: e for h, e in failures.items() if not isinstance(e, HostUnusable)}
    if unreachable:
        fail(f"{len(unreachable)} host(s) unreachable: " + "; ".join(map(str, unreachable.values())),
             EXIT_UNREACHABLE)
    errors = [str(e) for e in failures.values()] + [f"{r.host}: {e}" for r in results for e in r.errors]
    if errors or refusals:
        fail("preflight refused: " + "; ".join(errors + refusals), EXIT_FAULT)
    try:
        return await setup.settle_plan(sup, results, replan)
    except PlanError as e:
        fail(str(e), EXIT_FAULT)
        raise


def output_needs(sup: Supervisor, results: list, replan: bool) -> list:
    """What each output folder must hold for its hosts' shards, with the shard layout the run will
    use: the plan the hosts hold (unless --replan), else the one fleet.toml makes now."""
    from .footprint import needs
    config, engine = sup.config, sup.launcher
    held = [r.plan for r in results if r.plan]
    if held and not replan:
        places = engine.placements(max(held, key=lambda p: p.created))
    else:
        places = engine.place({h.name: [] for h in config.hosts} | {r.host: r.gpus for r in results})
    by_host: dict[str, list[int]] = {}
    for p in places:
        by_host.setdefault(p.host, []).append(p.shard)
    outputs = {h.name: config.output_dir(h) for h in config.hosts}
    return needs({r.host: r.report for r in results}, outputs, by_host, len(places), config.run.keep_local)


def output_verdicts(config: Config, results: list, groups: list, allow_partial: bool) -> list[str]:
    """Print the whole run's projection (and where it ships) and the warnings; return the refusals."""
    from .footprint import describe, disk_warnings, gb, shipping_lines, verdicts
    fp = next((r.report.footprint for r in results if r.report.footprint), None)
    refusals, warnings = verdicts(groups, allow_partial)
    if fp:
        click.echo(describe(fp), err=True)
        rates = {r.host: r.report.write_bps for r in results if r.report.write_bps}
        if rates:
            click.echo("output disks measured: " + ", ".join(f"{h} {gb(b)}/s" for h, b in sorted(rates.items()))
                       + " (fsync'd files, 8 at once)", err=True)
        warnings += disk_warnings(fp, groups, config.spec.expected.tokens_per_s_per_gpu, rates)
        if config.run.destination is not None:
            line, slow = shipping_lines(fp, config.run.destination, config.run.keep_local, groups,
                                        config.spec.expected.tokens_per_s_per_gpu,
                                        {r.host: r.report.uplink_bps for r in results})
            click.echo(line, err=True)
            warnings += slow
    for w in warnings:
        click.echo(f"warning: {w}", err=True)
    return refusals


@main.command()
@config_option
@click.option("--headless", is_flag=True, help="no TUI: print one line per state change; exit when "
                                                 "every shard is DONE, FATAL or STOPPED")
@click.option("--replan", is_flag=True, help="the run's plan (shard layout, model, data, layers) no "
                                             "longer matches fleet.toml: make a new one. Only when no "
                                             "shard is live; finished samples are kept")
@click.option("--allow-partial", is_flag=True, help="launch even where preflight projects more output "
                                                    "than the disk holds: shards stop when it is full")
@click.option("--metrics", metavar="HOST:PORT", default=None,
              help="serve the run's figures for Prometheus on http://HOST:PORT/metrics while supervising "
                   "(e.g. 127.0.0.1:9400)")
def up(config_path: str, headless: bool, replan: bool, allow_partial: bool, metrics: str | None) -> None:
    """Deploy the worker, launch a shard on every GPU and supervise them.

    The first `fleet up` fixes the run's plan (which shard runs where, and the identity of the
    model, data and layers) on every host; later commands follow it, and a fleet.toml that
    disagrees is refused with the differences. Re-running `fleet up` on a live run re-attaches:
    live shards are never started twice, failed ones are restarted and resume where they
    stopped. Quitting leaves the workers running. A host whose free disk cannot hold what its
    shards will write (preflight's projection) is refused unless --allow-partial.
    """
    config = load(config_path)

    async def go() -> int:
        t0 = time.monotonic()
        async with Supervisor(config, on_log=lambda m: click.echo(f"  {time.monotonic() - t0:5.1f}s  {m}",
                                                                  err=True)) as sup:
            await deploy_and_plan(sup, replan, allow_partial)
            if metrics:
                await serve_metrics(sup, metrics)
            if not headless:
                from .tui.app import run_tui
                message = await run_tui(sup)
                if message:
                    print(message)
                return 0
            return await supervise_headless(sup)
    run_async(go)


async def serve_metrics(sup: Supervisor, address: str) -> None:
    """/metrics on `address`, from a snapshot the supervisor's loop takes every 2 s (the HTTP
    thread never reads the store itself); the server ends with the supervisor."""
    from .metrics import serve
    newest: dict = {"snap": None}

    async def keep() -> None:
        while True:
            newest["snap"] = sup.snapshot()
            await asyncio.sleep(2.0)
    try:
        server = serve(address, lambda: newest["snap"])
    except (OSError, ValueError) as e:
        fail(f"--metrics {address}: cannot serve there: {e}", EXIT_CONFIG)
    task = asyncio.get_running_loop().create_task(keep())
    sup.on_close(lambda: (task.cancel(), server.shutdown(), server.server_close()))
    click.echo(f"metrics: http://{address}/metrics", err=True)


async def supervise_headless(sup: Supervisor) -> int:
    """`up --headless`: one line per transition as it is published, until every shard settles
    (DONE, FATAL or STOPPED) or the run's rows are all done (a lost host's by the others); 0 when
    they are."""
    sup.on_log = lambda m: click.echo(f"  {m}", err=True)
    sup.subscribe(lambda changes: [click.echo(line) for line in render.transition_lines(changes, sup.snapshot())])
    await sup.start()
    await sup.launch_all()
    sup.settled_event.clear()                     # judged again once the launches are in flight
    while not (sup.settled_event.is_set() or (sup.replayed and not sup.acting and
                                              (sup.snapshot().totals.settled or sup.snapshot().totals.finished))):
        if sup.runner.done():                     # supervising itself ended: say why, never hang
            why = sup.runner.exception() if not sup.runner.cancelled() else "cancelled"
            await sup.close()
            fail(f"supervising stopped: {why!r}; the workers keep running (fleet status)", EXIT_FAULT)
        try:                                      # the decide loop's event, or a look once a second
            async with asyncio.timeout(1.0):
                await sup.settled_event.wait()
        except asyncio.TimeoutError:
            pass
    await sup.close()
    snap = sup.snapshot()
    click.echo(render.format_status(snap))
    return 0 if snap.totals.finished else EXIT_FAULT


# --- status ------------------------------------------------------------------------------------

@main.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="print the snapshot as JSON (schema fleet.status/2)")
@click.option("--json-schema", "as_schema", is_flag=True,
              help="print the JSON schema of --json's output and exit (reads no fleet.toml)")
@click.option("--prometheus", "as_prometheus", is_flag=True,
              help="print the snapshot in Prometheus' text format (for node_exporter's textfile collector)")
def status(config_path: str, as_json: bool, as_schema: bool, as_prometheus: bool) -> None:
    """One snapshot of the run: hosts, GPUs, shards, throughput, ETA.

    The same verdicts `fleet up` acts on (fleet status acts on none). Exit 0 healthy, done or
    stopped, 1 a shard STALLED/FAILED/BACKOFF/FATAL, 2 config error, 3 a host unreachable.
    """
    if as_schema:
        click.echo(json.dumps(json_schema(), indent=2))
        return
    config = load(config_path)

    async def go() -> int:
        sup = Supervisor(config)
        try:
            snap = await sup.read_once()
        except PlanError as e:
            fail(str(e), EXIT_CONFIG)
        finally:
            await sup.close()
        if as_json:
            click.echo(snap.to_json())
        elif as_prometheus:
            from .metrics import text
            click.echo(text(snap), nl=False)
        elif not snap.shards and all(h.reachable for h in snap.hosts):
            click.echo(f"run {config.run.name}: nothing launched yet (fleet up starts it)")
        else:
            click.echo(render.format_status(snap))
        return status_exit_code(snap)
    run_async(go)


# --- down / restart ----------------------------------------------------------------------------

@main.command()
@config_option
@click.option("--yes", "-y", is_flag=True, help="do not ask")
@click.option("--timeout", default=10.0, show_default=True, help="seconds before SIGKILL")
def down(config_path: str, yes: bool, timeout: float) -> None:
    """Stop every shard of the run (SIGTERM, then SIGKILL). Output already written stays."""
    config = load(config_path)

    async def go() -> int:
        sup = Supervisor(config)
        try:
            try:
                snap = await sup.read_once()
            except PlanError as e:
                fail(str(e), EXIT_CONFIG)
            if all(s.state in SETTLED for s in snap.shards) and all(h.reachable for h in snap.hosts):
                click.echo(f"run {config.run.name}: nothing is running or waiting to restart; nothing to stop")
                return 0
            if not yes and not click.confirm(f"stop every shard of run {config.run.name}?", default=False):
                fail("not confirmed; nothing stopped", EXIT_FAULT)
            results = await sup.stop_all(timeout)
        finally:
            await sup.close()
        code = 0
        for r in results:
            click.echo(r.text(), err=r.error is not None)
            if r.error is not None:
                code = EXIT_UNREACHABLE
            elif r.still_running and not code:
                code = EXIT_FAULT
        return code
    run_async(go)


async def find_shard(sup: Supervisor, ref: str) -> int:
    """Read the fleet once and resolve SHARD (id or HOST:GPU) on a reachable host, or exit."""
    try:
        await sup.read_once()
    except PlanError as e:
        fail(str(e), EXIT_CONFIG)
    try:
        k = sup.resolve_shard(ref)
    except KeyError as e:
        down = [h for h in sup.store.hosts.values() if h.reachable is False]
        if down:                                 # its shard may be on a host not read: say why
            fail("; ".join(h.error or f"{h.name}: unreachable" for h in down), EXIT_UNREACHABLE)
        fail(str(e.args[0]), EXIT_CONFIG)
    host = sup.store.hosts[sup.shards[k].placement.host]
    if host.reachable is False:
        fail(host.error or f"{host.name}: unreachable", EXIT_UNREACHABLE)
    return k


@main.command()
@config_option
@click.argument("shard")
def restart(config_path: str, shard: str) -> None:
    """Restart SHARD (an id, or HOST:GPU); it resumes from its manifest.

    It runs as the run's plan says (its GPU, its share of the rows), whatever fleet.toml or an
    unreachable host says now; a fleet.toml that changed what is written is refused.
    """
    config = load(config_path)

    async def go() -> int:
        sup = Supervisor(config)
        try:
            k = await find_shard(sup, shard)
            if sup.plan and (diffs := differences(sup.plan.spec, spec_of(config))):
                fail(refusal(sup.plan, diffs), EXIT_FAULT)
            result = (await sup.request([k], "restart", wait=config.spec.supervise.stop_grace + 30))[k]
        finally:
            await sup.close()
        if result.status == "refused":
            fail(result.detail or "refused", EXIT_FAULT)
        if result.status == "error":
            fail(result.detail or "error", EXIT_UNREACHABLE)
        click.echo(describe(result) + (f" (launch {result.launch})" if result.launch else ""))
        return 0
    run_async(go)


# --- logs --------------------------------------------------------------------------------------

@main.command()
@config_option
@click.argument("shard")
@click.option("-f", "--follow", is_flag=True, help="keep printing new lines")
@click.option("-n", "--lines", default=100, show_default=True, help="lines from the end")
def logs(config_path: str, shard: str, follow: bool, lines: int) -> None:
    """Print SHARD's log (an id, or HOST:GPU)."""
    config = load(config_path)

    async def go() -> int:
        sup = Supervisor(config)
        try:
            k = await find_shard(sup, shard)
            async for line in sup.log_lines(k, lines, follow):
                click.echo(line)                  # (printable already: follow.lines)
        except HostError as e:
            fail(str(e), EXIT_UNREACHABLE)
        finally:
            await sup.close()
        return 0
    run_async(go)


# --- verify ------------------------------------------------------------------------------------

@main.command()
@config_option
@click.option("--shallow", is_flag=True, help="check the manifests only, not every file")
@click.option("--repair", is_flag=True, help="drop the manifest entries of missing or broken files "
                                             "(and remove those files) so the next `fleet up` redoes "
                                             "exactly them; needs every shard stopped")
def verify(config_path: str, shallow: bool, repair: bool) -> None:
    """Check the output: every global index present exactly once (written or recorded as skipped),
    every file readable, shapes as declared, values finite. Exit 1 listing what is wrong."""
    config = load(config_path)
    if repair and shallow:
        fail("--repair opens every file; drop --shallow", EXIT_CONFIG)

    async def go() -> int:
        from .verify import reopen_repaired, skip_problem, verify_fleet
        sup = Supervisor(config)
        try:
            if repair and (live := await setup.live_shards(sup)):
                fail(f"--repair needs every shard stopped; live: {', '.join(live)} (fleet down first)",
                     EXIT_FAULT)
            result, failures = await verify_fleet(
                config, {n: l.transport for n, l in sup.links.items()}, deep=not shallow, repair=repair)
            skip_problem(result, config.run.max_skip_fraction)
            if result.repaired or (repair and result.missing):
                for line in await reopen_repaired(sup, result):
                    click.echo(line)
        except HostError as e:
            fail(str(e), EXIT_FAULT)
        finally:
            await sup.close()
        for host, why in failures.items():
            click.echo(f"unreachable: {why}", err=True)
        for host, other in result.shared.items():
            click.echo(f"{host}: shares {other}'s output folder (counted once)")
        fraction = f" ({result.skip_fraction:.2%})" if result.skip_fraction is not None else ""
        click.echo(f"{result.written} written, {len(result.skipped)} skipped{fraction}, "
                   f"{result.num_samples if result.num_samples is not None else '?'} in the dataset"
                   + (f" (format {result.format}" + (", fp8" if result.dtype == "fp8" else "") + ")"
                      if result.format else ""))
        for i, why in list(result.skipped.items())[:20]:
            click.echo(f"  skipped {i}: {why}")
        if result.missing:
            shown = runs_text(result.missing[:20], ", ")
            click.echo(f"missing: {sum(b - a for a, b in result.missing)} sample(s): {shown}")
        for p in result.problems[:50]:
            click.echo(f"problem: {p}")
        if result.unrecorded_files:
            click.echo(f"note: {result.unrecorded_files} file(s) not in a manifest (a restart rewrites them)")
        if result.checked_rows:
            layers = " · ".join(f"{k} {c:.4f}" for k, c in zip(result.layer_ids or range(99), result.worst_cosine))
            click.echo(f"reference checks: {result.checked_rows} row(s) re-computed alone; worst cosine per "
                       f"layer: {layers}")
        for note in result.notes[:20]:
            click.echo(f"note: {note}")
        for command in dict.fromkeys(result.commands.values()):       # one line per distinct folder
            hosts = [h for h, c in result.commands.items() if c == command]
            click.echo(f"train ({', '.join(hosts)}): {command}")
        if failures:
            return EXIT_UNREACHABLE
        if result.ok:
            click.echo("verify: OK")
            return 0
        return EXIT_FAULT
    run_async(go)


@main.command()
@config_option
@click.argument("folder", type=click.Path(file_okay=False))
def download(config_path: str, folder: str) -> None:
    """Copy the run's destination ([run] destination) to FOLDER, ready for its trainer: every file
    (rclone: resumable, checksummed, 16 at once; its progress every 10 s), then speculators'
    prepared/ index over every row (an object store cannot hold it). Prints the training command
    for FOLDER. Credentials as the hosts have them: this machine's AWS variables or ~/.aws, and
    fleet.toml's [run] env (AWS_SHARED_CREDENTIALS_FILE, say)."""
    config = load(config_path)
    if config.run.destination is None:
        fail(f"{config_path}: [run] destination is not set: the output stays on the hosts "
             f"(copy each host's [run] output, or `fleet export`)", EXIT_CONFIG)
    os.environ.update(config.run.env)
    try:
        from worker.download import download as fetch
        from worker.ship import ShipError
    except ImportError as e:
        fail(f"fleet download needs the worker's packages here: pip install 'fleet[worker]' ({e})", EXIT_CONFIG)
    try:
        command = fetch(config.run.destination, folder, lambda line: click.echo(line, err=True))
    except (ShipError, OSError, ValueError) as e:
        fail(str(e), EXIT_FAULT)
    click.echo(f"train: {command}")


# --- export ------------------------------------------------------------------------------------

@main.command()
@config_option
@click.option("--format", "fmt", required=True, type=click.Choice(FORMATS),
              help="the trainer layout to write")
@click.option("--out", required=True, help="the folder to write on every host (a path on the host, "
                                           "like [run] output)")
def export(config_path: str, fmt: str, out: str) -> None:
    """Convert the run's output on every host to another trainer's layout (no GPU needed; it
    resumes if stopped). Exit 1 if a host reported a problem, 3 if one was unreachable."""
    config = load(config_path)

    async def go() -> int:
        from .export import export_fleet
        sup = Supervisor(config)
        try:
            result = await export_fleet(config, {n: l.transport for n, l in sup.links.items()}, fmt, out)
        except HostError as e:
            fail(str(e), EXIT_FAULT)
        finally:
            await sup.close()
        for host, s in result.summaries.items():
            click.echo(f"{host}: {s.written} written, {s.skipped} skipped -> {s.out} ({fmt})")
        for why in list(result.failed.values()) + list(result.unreachable.values()):
            click.echo(f"error: {why}", err=True)    # a host's export that stopped says why last
        if result.unreachable:
            return EXIT_UNREACHABLE
        return EXIT_FAULT if result.failed else 0
    run_async(go)


if __name__ == "__main__":
    main()
