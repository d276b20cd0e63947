"""The run's figures in Prometheus' text format, for a team's dashboards (issue 39).

One pure projection of a FleetSnapshot — the numbers `status --json` prints and the live view draws,
never figures of its own — into metric families (`families`), written by prometheus_client's own
exposition code: `fleet status --prometheus` prints them once (a node_exporter textfile), and
`fleet up --metrics HOST:PORT` serves the newest snapshot on /metrics while it supervises.

Labels: run on every series; host, gpu, shard where they apply; a shard's state is one series per
state it could be in, 1 for the one it is in (`fleet_shard_state`), so a dashboard can count them.
"""

from __future__ import annotations

from typing import Callable, Iterable
from wsgiref.simple_server import WSGIServer

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from .schema import FleetSnapshot
from .state import State


def families(snap: FleetSnapshot) -> list[Metric]:
    """Every metric of the snapshot: per shard, per GPU, per host and for the run."""
    run = snap.run

    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(f"fleet_{name}", doc, labels=("run",) + labels)

    out: list[Metric] = []
    shard_labels = ("shard", "host", "gpu")
    state = gauge("shard_state", "1 for the state the shard is in, 0 for the others", shard_labels + ("state",))
    per_shard = {
        "samples_done": ("shard_samples_done", "samples written or skipped", lambda s: s.done + s.skipped),
        "samples_total": ("shard_samples_total", "samples the shard holds", lambda s: s.total),
        "tokens_done": ("shard_tokens_done", "tokens extracted (absent for a [job])", lambda s: s.tokens),
        "tokens_total": ("shard_tokens_total", "tokens the shard holds, once sized", lambda s: s.total_tokens),
        "samples_per_s": ("shard_samples_per_second", "samples a second now", lambda s: s.samples_per_s),
        "tokens_per_s": ("shard_tokens_per_second", "tokens a second now", lambda s: s.tokens_per_s),
        "restarts": ("shard_restarts", "launches after the first", lambda s: s.restarts),
        "progress_age": ("shard_last_progress_age_seconds", "seconds since its last progress",
                         lambda s: s.progress_age_s),
        "eta": ("shard_eta_seconds", "seconds until it ends, at its pace", lambda s: s.eta_s),
    }
    shard_gauges = {k: gauge(name, doc, shard_labels) for k, (name, doc, _) in per_shard.items()}
    for s in snap.shards:
        labels = [run, str(s.id), s.host, str(s.gpu)]
        for st in State:
            state.add_metric(labels + [st.value], 1.0 if s.state == st else 0.0)
        for key, (_, _, value) in per_shard.items():
            if (v := value(s)) is not None:
                shard_gauges[key].add_metric(labels, float(v))
    out += [state, *shard_gauges.values()]

    up = gauge("host_up", "1 when the host is reachable", ("host",))
    mem_used = gauge("gpu_memory_used_bytes", "GPU memory in use", ("host", "gpu"))
    mem_total = gauge("gpu_memory_total_bytes", "GPU memory in all", ("host", "gpu"))
    util = gauge("gpu_utilization_ratio", "GPU utilisation, 0 to 1", ("host", "gpu"))
    for h in snap.hosts:
        up.add_metric([run, h.name], 1.0 if h.reachable else 0.0)
        for g in h.gpus or []:
            labels = [run, h.name, str(g.index)]
            if g.mem_used is not None:
                mem_used.add_metric(labels, float(g.mem_used))
            if g.mem_total is not None:
                mem_total.add_metric(labels, float(g.mem_total))
            if g.util is not None:
                util.add_metric(labels, g.util / 100.0)
    out += [up, mem_used, mem_total, util]

    t = snap.totals
    for name, doc, figure in (
            ("samples_per_second", "the run's samples a second", t.samples_per_s),
            ("tokens_per_second", "the run's tokens a second", t.tokens_per_s),
            ("expected_tokens_per_second", "what the run is expected to do ([expected] x its GPUs)",
             t.expected_tokens_per_s),
            ("expected_ratio", "measured over expected", t.ratio),
            ("eta_seconds", "seconds until the run's last shard ends", t.eta_s),
            ("samples_done", "samples written or skipped", t.done),
            ("samples_total", "samples in the run", t.total),
            ("finished", "1 once every row of the run is done", 1.0 if t.finished else 0.0)):
        family = gauge(name, doc)
        if figure is not None:
            family.add_metric([run], float(figure))
        out.append(family)
    return out


def text(snap: FleetSnapshot) -> str:
    """The snapshot in Prometheus' text exposition format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Newest(lambda: snap))
    return generate_latest(registry).decode()


class _Newest(Collector):
    """A collector that reads the newest snapshot at every scrape."""

    def __init__(self, newest: Callable[[], FleetSnapshot | None]):
        self.newest = newest

    def collect(self) -> Iterable[Metric]:
        snap = self.newest()
        return families(snap) if snap is not None else []


class AddressError(ValueError):
    """--metrics was given something that is no HOST:PORT."""


def parse_address(address: str) -> tuple[str, int]:
    """'127.0.0.1:9400', ':9400' (loopback), '[::1]:9400' -> (host, port); AddressError (one line) else."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise AddressError(f"{address!r} is not HOST:PORT with a port from 1 to 65535 (e.g. 127.0.0.1:9400)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "127.0.0.1", int(port)


def serve(address: str, newest: Callable[[], FleetSnapshot | None]) -> WSGIServer:
    """Serve /metrics on `address` (HOST:PORT) from `newest()` at each scrape, in a thread of
    prometheus_client's own; returns its server (shutdown() stops it). Raises AddressError or OSError."""
    from prometheus_client.exposition import start_http_server
    host, port = parse_address(address)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Newest(newest))
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server
