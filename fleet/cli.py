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
from typing import Any, Callable, Coroutine, NoReturn

import click

from worker.identity import differences

from worker.formats import FORMATS
from worker.protocol import Plan
from worker.text import runs_text

from . import control, render
from .actions import describe
from .client import Client, RequestFailed, StartFailed, SupervisorGone, differs, host_stop, join, join_at, start
from .client import stop as stop_supervisor
from .config import Config, ConfigError, load_config
from .schema import json_schema
from .snapshot import status_exit_code
from .state import SETTLED
from .supervisor import Supervisor
from .plan import PlanError, refusal, spec_of
from .runhome import RunHome
from .transport import HostError

from .setup import EXIT_CONFIG, EXIT_FAULT, EXIT_UNREACHABLE

def config_default() -> str:
    """A command's -c: its own, else the one given before the command (`fleet -c x.toml up`)."""
    ctx = click.get_current_context(silent=True)
    return (ctx.find_root().params.get("config_path") if ctx else None) or "fleet.toml"


config_option = click.option("-c", "--config", "config_path", default=config_default, show_default="fleet.toml",
                             type=click.Path(dir_okay=False), help="the run's fleet.toml")


def fail(message: str, code: int) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def load(path: str) -> Config:
    try:
        return load_config(path)
    except ConfigError as e:
        fail(str(e), EXIT_CONFIG)
        raise                                             # unreachable


def run_async(fn: Callable[[], Coroutine[Any, Any, int]]) -> None:
    try:
        code = asyncio.run(fn())
    except KeyboardInterrupt:
        click.echo("interrupted; the workers keep running, and the run's supervisor keeps supervising where "
                   "one runs (fleet status to see them)", err=True)
        code = 130
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fleet")
@click.option("-c", "--config", "config_path", default=None, type=click.Path(dir_okay=False),
              help="the run's fleet.toml for the command that follows (each command also takes -c)")
def main(config_path: str | None) -> None:
    """Run one hidden-state extraction worker per GPU across a fleet of hosts, and watch it.

    \b
    fleet up            start the run's supervisor (or join it) and open the live view
    fleet serve         run the run's supervisor in the foreground (a head node, systemd, tmux)
    fleet status        one snapshot (--json for scripts)
    fleet logs SHARD    a shard's log (-f to follow)
    fleet restart SHARD restart a shard (it resumes)
    fleet down          stop every shard
    fleet verify        check the output: every sample once, every file sound
    fleet export        convert the output to another trainer's layout on every host
    fleet download DIR  copy the run's destination (S3, SFTP, a path) to DIR, checked
    """


# --- the run's supervisor ---------------------------------------------------------------------

def home_of(config: Config) -> RunHome:
    return RunHome(config.run.name, config.path)


at_option = click.option("--at", metavar="HOST", default=None,
                         help="the run's supervisor runs on another machine: join it there over SSH (a "
                              "[[hosts]] name of fleet.toml, or [user@]host[:port] through ~/.ssh/config)")


async def joined_at(config: Config, at: str, who: str) -> tuple[Client, control.Welcome]:
    try:
        return await join_at(config, at, who)
    except RequestFailed as e:
        fail(str(e), e.code)
        raise


def reconnect(config: Config, at: str | None):
    """Another connection to the same supervisor (the view opens one for a shard's log)."""
    async def again() -> Client | None:
        if at is None:
            return await Client.connect(home_of(config).socket)
        try:
            return (await join_at(config, at, "log"))[0]
        except RequestFailed:
            return None
    return again


def check_metrics(address: str | None) -> None:
    if address:
        from .metrics import AddressError, parse_address
        try:
            parse_address(address)
        except AddressError as e:
            fail(f"--metrics {e}", EXIT_CONFIG)


async def reach(config: Config, who: str, options: list[str], restart: str | None = None):
    """The run's supervisor for `fleet up`: joined where it runs for this fleet.toml (restarted
    first when it reads another fleet.toml or fleet, or `restart` says why), else started in the
    background. Returns (client, welcome, started)."""
    home = home_of(config)
    joined = await join(home, config, who)
    if joined is not None:
        client, welcome = joined
        why = restart or differs(welcome, config) or ("its setup was refused" if welcome.phase == "failed" else None)
        if why is None:
            click.echo(f"joining the run's supervisor (pid {welcome.pid}, log {welcome.log})", err=True)
            return client, welcome, False
        click.echo(f"restarting the run's supervisor (pid {welcome.pid}): {why}", err=True)
        if not await stop_supervisor(client, home):
            fail(f"the run's supervisor (pid {welcome.pid}) did not stop; see {welcome.log}", EXIT_FAULT)
    click.echo(f"starting the run's supervisor in the background (log {home.log})", err=True)
    try:
        client, welcome = await start(home, config, options, who)
    except StartFailed as e:
        fail(str(e), e.code)
    return client, welcome, True


def tell(msg) -> None:
    """What a client prints of what the supervisor pushes: setup's lines, its new log lines, the
    transitions' lines; a refusal ends the command with its exit code."""
    if isinstance(msg, control.Say):
        click.echo(msg.text, err=msg.err)
    elif isinstance(msg, control.Note) and not msg.past:
        click.echo(f"  {msg.text}", err=True)
    elif isinstance(msg, control.Changes):
        for line in msg.lines:
            click.echo(line)
    elif isinstance(msg, control.Failed):
        fail(msg.message, msg.code)


async def follow_setup(client: Client) -> control.Snap:
    """Print what the supervisor's setup says (the deploy's steps, the preflight table) until it
    supervises; exits with setup's refusal."""
    client.send(control.Watch())
    while True:
        try:
            msg = await client.next_push()
        except SupervisorGone as e:
            fail(f"the run's supervisor stopped during its setup ({e}); see its log", EXIT_FAULT)
        tell(msg)
        if isinstance(msg, control.Snap) and msg.phase == "supervising":
            return msg


@main.command()
@config_option
@click.option("--headless", is_flag=True, help="no view: print one line per state change (and where each "
              "shard is, every --every seconds); exit when the "
                                                 "run is finished (0) or nothing more happens (1)")
@click.option("--replan", is_flag=True, help="the run's plan (shard layout, model, data, layers) no "
                                             "longer matches fleet.toml: make a new one. Only when no "
                                             "shard is live; finished samples are kept")
@click.option("--allow-partial", is_flag=True, help="launch even where preflight projects more output "
                                                    "than the disk holds: shards stop when it is full")
@click.option("--metrics", metavar="HOST:PORT", default=None,
              help="the run's supervisor serves the run's figures for Prometheus on http://HOST:PORT/metrics "
                   "for as long as it supervises (e.g. 127.0.0.1:9400)")
@click.option("--take-over", is_flag=True, help="another supervisor holds the run (another machine, or a "
                                                "copy of this fleet.toml): end its hold and supervise here")
@click.option("--every", "every_s", type=click.FloatRange(min=1), default=render.HEADLESS_PROGRESS_S,
              show_default=True, metavar="SECONDS", help="with --headless: how often to print each live "
                                                         "shard's done, rate and ETA")
@at_option
def up(config_path: str, headless: bool, replan: bool, allow_partial: bool, metrics: str | None,
       take_over: bool, every_s: float, at: str | None) -> None:
    """Supervise the run: start its supervisor (or join the one that runs), then watch it.

    The run's supervisor lives in the background, apart from this terminal: it deploys and
    preflights every host that answers, fixes the run's plan (which shard runs where, and the
    identity of the model, data and layers) or checks fleet.toml against it, launches every shard
    that is neither live nor done, and supervises — restarts, stalls, rows of lost or idle hosts,
    [notify], --metrics — until the run has ended and no client is left. Quitting the view (or
    closing the terminal) leaves it supervising; `fleet up` again joins it in a second, with no
    deploy. A host that does not answer never stops the others: its shards are UNKNOWN, and after
    host_lost_after its rows go to the others. A host whose free disk cannot hold what its shards
    will write (preflight's projection) is refused unless --allow-partial.
    """
    config = load(config_path)
    check_metrics(metrics)
    options = (["--replan"] if replan else []) + (["--allow-partial"] if allow_partial else []) + \
        (["--metrics", metrics] if metrics else []) + (["--take-over"] if take_over else []) + \
        ["--width", str(shutil.get_terminal_size((120, 24)).columns)]
    restart = "--replan" if replan else "--allow-partial" if allow_partial else "--take-over" if take_over else None

    async def go() -> int:
        if at is not None:
            if restart:
                fail(f"{restart} is for a supervisor started here; on {at}, give it to `fleet serve` there", EXIT_CONFIG)
            client, welcome = await joined_at(config, at, "up")
            started = False
            click.echo(f"joining the run's supervisor on {welcome.machine} (pid {welcome.pid}, log {welcome.log})",
                       err=True)
        else:
            client, welcome, started = await reach(config, "up", options, restart)
        snap = await follow_setup(client)
        since = 0.0
        try:
            if not started:
                since = float((await client.ask(control.Up())).data or 0.0)
                if metrics and (reply := await client.ask(control.Metrics(address=metrics))).error:
                    fail(reply.error, reply.code)
        except SupervisorGone as e:
            fail(f"the run's supervisor stopped: {e}", EXIT_FAULT)
        if headless:
            return await supervise_headless(client, since, home_of(config) if at is None else None, every_s)
        from .tui.app import run_tui
        message = await run_tui(client, reconnect(config, at), snap.snapshot)
        if message:
            print(message)
        return 0
    run_async(go)


async def supervise_headless(client: Client, since: float, home: RunHome | None,
                             every_s: float = render.HEADLESS_PROGRESS_S) -> int:
    """`up --headless`: one line per transition as the supervisor publishes it, until the run has
    ended (every shard settled, or every row done, nothing in flight); 0 when its rows are all
    done. Interrupted, the supervisor goes on; at the end, it goes once its last client has (this
    waits for that, so the next command reads the hosts themselves)."""
    latest = None
    shown = time.monotonic()
    try:
        while latest is None or not (latest.ended and latest.snapshot.time >= since):
            msg = await client.next_push()
            tell(msg)
            if isinstance(msg, control.Snap):
                latest = msg
                if time.monotonic() - shown >= every_s and not msg.ended:
                    shown = time.monotonic()
                    click.echo("\n".join(render.progress_lines(msg.snapshot)))
    except SupervisorGone as e:
        fail(f"the run's supervisor stopped ({e}); the workers keep running (fleet status)", EXIT_FAULT)
    await client.close()
    deadline = time.monotonic() + 15
    while home is not None and home.held() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    snap = latest.snapshot
    click.echo(render.format_status(snap))
    return 0 if snap.totals.finished else EXIT_FAULT


@main.command()
@config_option
@click.option("--stop", "stop_it", is_flag=True, help="stop the run's supervisor that runs here (the workers "
                                                      "keep running; `fleet up` starts it again)")
@click.option("--replan", is_flag=True, help="as for fleet up")
@click.option("--allow-partial", is_flag=True, help="as for fleet up")
@click.option("--metrics", metavar="HOST:PORT", default=None, help="serve /metrics there while supervising")
@click.option("--take-over", is_flag=True, help="as for fleet up")
@click.option("--background", is_flag=True, hidden=True, help="started by a client: its output is the log")
@click.option("--width", type=int, default=None, hidden=True, help="the starting client's terminal width")
def serve(config_path: str, stop_it: bool, replan: bool, allow_partial: bool, metrics: str | None,
          take_over: bool, background: bool, width: int | None) -> None:
    """Run the run's supervisor here, in the foreground: what `fleet up` starts in the background.

    For a head node or one of the GPU hosts, so the run is supervised whatever becomes of your
    laptop: under systemd (`ExecStart=fleet serve -c /path/fleet.toml`) or in tmux (`tmux new -d -s
    fleet fleet serve`). It deploys, preflights, launches what is neither live nor done and
    supervises until the run has ended and no client is left (or --stop, or SIGTERM). Its log and
    socket: ~/.local/state/fleet/<run>-<id>/ ($FLEET_STATE_DIR to move them). One per run: a
    second (here, or on another machine: the hosts hold the run for the first) refuses and says
    where the first runs.
    """
    config = load(config_path)
    home = home_of(config)
    if stop_it:
        async def go() -> int:
            joined = await join(home, config, "serve --stop")
            if joined is None:
                click.echo(f"no supervisor of run {config.run.name} runs here ({home.dir})")
                return 0
            client, welcome = joined
            if not await stop_supervisor(client, home):
                fail(f"the run's supervisor (pid {welcome.pid}) did not stop; see {welcome.log}", EXIT_FAULT)
            click.echo(f"stopped supervising run {config.run.name} (pid {welcome.pid}); the workers keep running")
            return 0
        run_async(go)
    check_metrics(metrics)
    from .service import serve_forever
    echo = None if background else (lambda line: click.echo(line, err=True))
    sys.exit(serve_forever(config, home, echo, replan=replan, allow_partial=allow_partial, metrics=metrics,
                           take_over=take_over, width=width))


async def ask_supervisor(config: Config, who: str, at: str | None = None) -> tuple[Client, control.Welcome] | None:
    """The run's supervisor here (or `at` another machine), if one runs (a note on stderr when it
    reads another fleet.toml)."""
    joined = await join(home_of(config), config, who) if at is None else await joined_at(config, at, who)
    if joined is not None and joined[1].phase == "failed":         # its setup was refused: it is going
        await joined[0].close()
        return None
    if joined is not None and (why := differs(joined[1], config)):
        click.echo(f"note: the run's supervisor (pid {joined[1].pid}) answers; {why} (`fleet up` restarts it)",
                   err=True)
    return joined


# --- status ------------------------------------------------------------------------------------

@main.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="print the snapshot as JSON (schema fleet.status/3)")
@click.option("--json-schema", "as_schema", is_flag=True,
              help="print the JSON schema of --json's output and exit (reads no fleet.toml)")
@click.option("--prometheus", "as_prometheus", is_flag=True,
              help="print the snapshot in Prometheus' text format (for node_exporter's textfile collector)")
@click.option("--from-hosts", is_flag=True, help="read the hosts' records here, over SSH, whether or not a "
                                                   "supervisor runs (what status does when none does)")
@at_option
def status(config_path: str, as_json: bool, as_schema: bool, as_prometheus: bool, from_hosts: bool,
           at: str | None) -> None:
    """One snapshot of the run: hosts, GPUs, shards, throughput, ETA.

    From the run's supervisor when one runs here (the verdicts it acts on), else read from the
    hosts once (said on stderr; it acts on nothing). Exit 0 healthy, done or stopped, 1 a shard
    STALLED/FAILED/BACKOFF/FATAL, 2 config error, 3 a host unreachable.
    """
    if as_schema:
        click.echo(json.dumps(json_schema(), indent=2))
        return
    config = load(config_path)

    async def go() -> int:
        snap = None
        if not from_hosts and (joined := await ask_supervisor(config, "status", at)) is not None:
            client, welcome = joined
            try:
                msg = await client.ask(control.SnapshotRequest())
            except SupervisorGone:
                msg = None
            await client.close()
            if msg is not None and msg.phase in ("setup", "launching") and not msg.snapshot.shards:
                click.echo(f"run {config.run.name}: its supervisor (pid {welcome.pid}) is deploying and "
                           f"preflighting (fleet up shows it; log {welcome.log})")
                return 0
            snap = msg.snapshot if msg is not None else None
        if snap is None:
            if not from_hosts:
                click.echo(f"fleet: no supervisor runs for run {config.run.name} here: read from the hosts once",
                           err=True)
            sup = Supervisor(config)
            try:
                snap = await sup.read_once()
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
@at_option
def down(config_path: str, yes: bool, timeout: float, at: str | None) -> None:
    """Stop every shard of the run (SIGTERM, then SIGKILL). Output already written stays.

    Through the run's supervisor when one runs (it then goes, the run being stopped), else
    host by host; an unreachable host is said and the others are stopped."""
    config = load(config_path)

    async def go() -> int:
        joined = await ask_supervisor(config, "down", at)
        sup = None if joined else Supervisor(config)
        try:
            if joined:
                snap = (await joined[0].ask(control.SnapshotRequest())).snapshot
            else:
                assert sup is not None, "made above when no supervisor runs"
                snap = await sup.read_once()
            if all(s.state in SETTLED for s in snap.shards) and all(h.reachable for h in snap.hosts):
                click.echo(f"run {config.run.name}: nothing is running or waiting to restart; nothing to stop")
                return 0
            if not yes and not click.confirm(f"stop every shard of run {config.run.name}?", default=False):
                fail("not confirmed; nothing stopped", EXIT_FAULT)
            if joined:
                reply = await joined[0].ask(control.StopAll(timeout=timeout))
                if reply.error:
                    fail(reply.error, reply.code or EXIT_FAULT)
                results = [host_stop(h) for h in reply.stopped]
            else:
                assert sup is not None, "made above when no supervisor runs"
                results = await sup.stop_all(timeout)
        except PlanError as e:
            fail(str(e), EXIT_CONFIG)
        except SupervisorGone as e:
            fail(f"the run's supervisor stopped ({e}); try again", EXIT_FAULT)
        finally:
            if joined:
                await joined[0].close()
            else:
                assert sup is not None, "made above when no supervisor runs"
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
@at_option
def restart(config_path: str, shard: str, at: str | None) -> None:
    """Restart SHARD (an id, or HOST:GPU); it resumes from its manifest.

    It runs as the run's plan says (its GPU, its share of the rows), whatever fleet.toml or an
    unreachable host says now; a fleet.toml that changed what is written is refused.
    """
    config = load(config_path)

    async def go() -> int:
        wait = config.spec.supervise.stop_grace + 30
        if (joined := await ask_supervisor(config, "restart", at)) is not None:
            client = joined[0]
            try:
                reply = await client.ask(control.Act(kind="restart", shards=[shard], wait=wait))
            except SupervisorGone as e:
                fail(f"the run's supervisor stopped ({e}); try again", EXIT_FAULT)
            finally:
                await client.close()
            if reply.error:
                fail(reply.error, reply.code or EXIT_FAULT)
            result = reply.acted[0].result()
        else:
            sup = Supervisor(config)
            try:
                k = await find_shard(sup, shard)
                if sup.plan and (diffs := differences(sup.plan.spec, spec_of(config))):
                    fail(refusal(sup.plan, diffs), EXIT_FAULT)
                result = (await sup.request([k], "restart", wait=wait))[k]
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
@at_option
def logs(config_path: str, shard: str, follow: bool, lines: int, at: str | None) -> None:
    """Print SHARD's log (an id, or HOST:GPU)."""
    config = load(config_path)

    async def go() -> int:
        if (joined := await ask_supervisor(config, "logs", at)) is not None:
            client = joined[0]
            try:
                async for line in client.stream(control.Log(shard=shard, last=lines, follow=follow)):
                    click.echo(line)
            except RequestFailed as e:
                fail(str(e), e.code)
            except SupervisorGone as e:
                fail(f"the run's supervisor stopped ({e})", EXIT_FAULT)
            finally:
                await client.close()
            return 0
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
            if repair and (live := await sup.live_shards()):
                fail(f"--repair needs every shard stopped; live: {', '.join(live)} (fleet down first)",
                     EXIT_FAULT)
            for line in await sup.tell_moved():          # a host back from being lost learns first
                click.echo(line)
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
        if result.copies:                 # a trainer over these folders would read those rows twice
            click.echo(f"train: not yet: {result.copies} row(s) have a second copy that a trainer would read as "
                       f"well; `fleet verify --repair` removes the copies that do not count")
        else:
            for command in dict.fromkeys(result.commands.values()):   # one line per distinct folder
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
