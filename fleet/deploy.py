"""Putting the worker on a host and checking the host can run its shards.

The worker package is uploaded into a content-hashed folder (`<root>/<run>/code/<hash>/worker`):
an unchanged worker is never uploaded twice, and processes still running old code keep it.
"""

from __future__ import annotations

import json
import os
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Protocol, TypeVar

from worker import protocol
from worker.text import bytes_text, last_line, printable_data

from .config import Config, HostSpec
from .bundle import code_dir, worker_hash, worker_tarball
from .jobs import output_args
from .transport import HostError, HostUnusable, Transport

def _python_argv(config: Config, host: HostSpec, module: str, *args: str,
                 env: dict[str, str] | None = None) -> list[str]:
    """`python -m worker.<module>` with the deployed code on PYTHONPATH (no shell involved), and
    `env` (a check that must see what the shards see: [run] env); only through `worker_argv`,
    which makes sure that code is there."""
    return ["env", f"PYTHONPATH={code_dir(config, host)}", *(f"{k}={v}" for k, v in (env or {}).items() if k != "PYTHONPATH"),
            config.python(host), "-m", f"worker.{module}", *args]


async def worker_argv(t: Transport, config: Config, host: HostSpec, module: str, *args: str,
                      env: dict[str, str] | None = None) -> list[str]:
    """`_python_argv`, with this fleet's worker put on the host first where it is not there yet
    (checked once a connection): `fleet status`, `down` or `verify` before any `fleet up`, or
    after fleet was upgraded here, run the worker this fleet ships — not a missing folder, and
    not whatever `worker` the host's Python happens to have installed."""
    if t.worker_at != code_dir(config, host):
        await upload_worker(t, config, host)
    return _python_argv(config, host, module, *args, env=env)


def _python_missing(config: Config, host: HostSpec, stderr: str) -> str | None:
    """The host's python did not start (a line naming it says not found), as opposed to a python
    that ran and failed (a traceback: a root it cannot write, under /proc, ...)."""
    python = config.python(host)
    if "Traceback (most recent call last)" in stderr:
        return None
    if any(python in line and ("No such file" in line or "not found" in line) for line in stderr.splitlines()):
        return f"{host.name}: python {python} not found (set python = ... for this host)"
    return None


R = TypeVar("R", bound=protocol.Reply)


async def run_worker_module(t: Transport, config: Config, host: HostSpec, module: str, *args: str,
                            reply: type[R], timeout: float | None = 300, input: bytes | None = None,
                            env: dict[str, str] | None = None) -> R:
    """Run a worker module that prints one JSON object, parsed here as `reply` (its one typed
    form: worker/protocol/replies.py); its errors, and a reply that is not one, become a HostUnusable."""
    r = await t.run(await worker_argv(t, config, host, module, *args, env=env), timeout=timeout, input=input)
    if r.rc != 0:
        why = _python_missing(config, host, r.stderr) or \
            f"{host.name}: worker.{module} failed (exit {r.rc}): {last_line(r.stderr)}"
        raise HostUnusable(why)
    try:
        d = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise HostUnusable(f"{host.name}: worker.{module} printed no result: {last_line(r.stdout)}") from None
    return parse_reply(reply, d, f"{host.name}: worker.{module}")


def parse_reply(reply: type[R], d: object, where: str) -> R:
    """`d` (a host's JSON) as `reply`; one that is not one is a HostUnusable saying `where` (the
    host and the command) and which field holds what."""
    if isinstance(d, dict):       # a host's text is data (its plan is fleet's own words, given back)
        d = {k: v if k == "plan" else printable_data(v) for k, v in d.items()}
    try:
        return reply.from_dict(d)
    except protocol.ReplyError as e:
        raise HostUnusable(f"{where}: {e}") from None


# Unpacks a gzip'd tar from stdin into a temp folder beside the target, then renames it into
# place: over an exec channel, so a host needs no SFTP subsystem, only the Python it runs anyway.
UNPACK = """
import io, os, shutil, sys, tarfile
dst = sys.argv[1]
tmp = "%s.tmp-%d" % (dst, os.getpid())
os.makedirs(os.path.dirname(dst), exist_ok=True)
shutil.rmtree(tmp, ignore_errors=True)
kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
with tarfile.open(fileobj=io.BytesIO(sys.stdin.buffer.read()), mode="r:gz") as tar:
    tar.extractall(tmp, **kw)
try:
    os.rename(tmp, dst)
except OSError:  # a concurrent deploy got there first: same content
    shutil.rmtree(tmp, ignore_errors=True)
"""


async def upload_worker(t: Transport, config: Config, host: HostSpec) -> bool:
    """Upload the worker unless this exact content is already there; True when uploaded."""
    target = code_dir(config, host)
    probe = await t.run(["test", "-f", os.path.join(target, "worker", "protocol", "__init__.py")], timeout=60)
    if probe.rc == 0:
        t.worker_at = target
        return False
    r = await t.run([config.python(host), "-c", UNPACK, target], timeout=300, input=worker_tarball())
    if r.rc != 0:
        why = _python_missing(config, host, r.stderr) or \
            f"{host.name}: upload to {target} failed ({config.python(host)}, exit {r.rc}): {last_line(r.stderr)}"
        raise HostUnusable(why)
    t.worker_at = target
    return True


@dataclass
class Preflight:
    host: str
    gpus: list[int] = field(default_factory=list)
    uploaded: bool = False
    report: protocol.PreflightReport = field(default_factory=protocol.PreflightReport)

    @property
    def errors(self) -> list[str]:
        return self.report.errors

    @property
    def warnings(self) -> list[str]:
        return self.report.warnings

    @property
    def plan(self) -> protocol.Plan | None:
        """The run's plan.json on this host, if it has one."""
        return self.report.plan

    @property
    def identity(self) -> protocol.WorkIdentity:
        """What this host's model and data are (worker.identity)."""
        return self.report.identity


class Preflighted(Protocol):
    """What preflight asks of the run's engine (its Launcher, fleet/launcher.py)."""

    def preflight_gpus(self, host: HostSpec) -> tuple[str, str]: ...
    async def host_checks(self, t: Transport, host: HostSpec, result: Preflight) -> str: ...


async def deploy_host(t: Transport, config: Config, host: HostSpec, engine: Preflighted,
                      step: Callable[[str], None] = lambda line: None) -> Preflight:
    """Upload, make demo assets if asked, then preflight (with the engine's own checks of the
    host). Raises HostError if unreachable. `step` is told each step as it begins (what `fleet up`
    prints while it deploys)."""
    result = Preflight(host.name)
    step(f"{host.name}: connecting to {host.address}")
    await t.connect()
    step(f"{host.name}: checking the worker ({worker_hash()[:8]})")
    result.uploaded = await upload_worker(t, config, host)
    step(f"{host.name}: worker " + ("uploaded" if result.uploaded else "already there"))
    run = config.run
    model = config.host_path(host, run.model) if run.model else ""
    data = config.host_path(host, run.data) if run.data else ""
    if run.demo:
        step(f"{host.name}: the demo model and data")
        made = await run_demo_assets(t, config, host, model, data)
        step(f"{host.name}: " + ("; ".join(made) if made else "demo model and data already there"))
    step(f"{host.name}: preflight: python, GPUs, model, data, layers, free disk")
    gpus, device = engine.preflight_gpus(host)
    k = run.gpus_per_shard
    args = ["--gpus", gpus, "--device", device, "--output", config.output_dir(host),
            *[a for folder in config.output_dirs(host)[1:] for a in ("--spill", folder)],
            "--run-dir", config.run_dir(host), "--gpus-per-shard", str(k),
            "--max-tokens-per-batch", str(run.max_tokens_per_batch)]
    args += output_args(run)
    if run.max_length:                     # rows the worker will skip or cut: the footprint knows
        args += ["--max-length", str(run.max_length), "--too-long", run.too_long]
    if model:
        args += ["--model", model]
    if data:
        args += ["--data", data]
    if config.spec.job is None:
        args.append("--builtin")
    destination = config.destination(host)     # (None when [run] destination is)
    if destination is not None:
        args += ["--destination", destination]
    report = await run_worker_module(t, config, host, "preflight", *args, reply=protocol.PreflightReport,
                                     timeout=300, env=run.env)     # the destination with the shards' env
    result.report = report
    result.gpus = report.gpus
    where = await engine.host_checks(t, host, result)
    step(f"{host.name}: preflight " + (f"refused: {result.errors[0]}" if result.errors else f"ok ({where})"))
    return result


async def run_demo_assets(t: Transport, config: Config, host: HostSpec, model: str, data: str) -> list[str]:
    """Make the demo's model and data where absent; what was made (worker.demo says)."""
    r = await t.run(await worker_argv(t, config, host, "demo", "--model", model, "--data", data), timeout=900)
    if r.rc != 0:
        raise HostUnusable(_python_missing(config, host, r.stderr) or
                        f"{host.name}: making the demo model failed: {last_line(r.stderr)}")
    return [line for line in r.stdout.splitlines() if line.startswith("made demo ")]


def format_preflight(results: list[Preflight], failures: dict[str, HostError],
                     needs: dict[str, int] | None = None, width: int | None = None) -> str:
    """One table: host, python, torch, GPUs, free disk, what its shards will write, verdict; the
    verdict wrapped by words under its own column at `width` (the terminal's), never mid-word by
    the terminal."""
    rows = [("host", "worker", "python", "torch", "gpus", "free", "needs", "result")]
    for p in results:
        r = p.report
        need = (needs or {}).get(p.host, r.estimated_bytes)
        verdict = "ERROR: " + p.errors[0] if p.errors else ("warning: " + p.warnings[0] if p.warnings else "ok")
        rows.append((p.host, "uploaded" if p.uploaded else "cached", r.python or "?", r.torch or "-",
                     ",".join(map(str, p.gpus)) or "-",
                     bytes_text(r.free_bytes), bytes_text(need), verdict))
    for host, e in failures.items():
        label = "REFUSED: " if isinstance(e, HostUnusable) else "UNREACHABLE: "
        rows.append((host, "-", "-", "-", "-", "-", "-", label + str(e).removeprefix(f"{host}: ")))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]) - 1)]
    indent = sum(widths) + 2 * len(widths)
    room = max((width or 10**6) - indent, 24)
    lines = []
    for row in rows:
        head = "  ".join(str(c).ljust(w) for c, w in zip(row[:-1], widths)) + "  "
        wrapped = textwrap.wrap(str(row[-1]), room, break_on_hyphens=False) or [""]
        lines.append(head + wrapped[0])
        lines += [" " * indent + more for more in wrapped[1:]]
    return "\n".join(lines)
