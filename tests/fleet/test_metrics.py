"""The run's figures for Prometheus (fleet/metrics.py): scraped from a real run's /metrics while it
runs (`fleet up --headless --metrics`), and printed once by `fleet status --prometheus` after it,
each parsed by prometheus_client's own parser and held against `status --json`'s figures."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, wait_for
from tests.fleet.conftest import fleet, supervisor_info
from tests.fleet.test_records import job_toml
from tests.sshd_server import free_port


def parse(text: str) -> dict[tuple, float]:
    """(metric name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float | None:
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]
    return found[0] if len(found) == 1 else None


def test_a_real_runs_figures_are_scraped_and_printed_in_prometheus_format(tmp_path):
    config = job_toml(tmp_path, {str(k): [[["ticks", 30, 0.5], ["print", "extract-only mode"]]] for k in (0, 1)})
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "up", "--headless", "--metrics",
                             f"127.0.0.1:{port}", "-c", config], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def scrape():
            try:
                return parse(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
            except OSError:
                return None
        # (shard 1 may run before shard 0's first line has given its total: wait for both)
        wait_for(lambda: (m := scrape()) and value(m, "fleet_shard_state", shard="1", state="RUNNING") == 1.0
                 and value(m, "fleet_shard_samples_total", shard="0") == 30.0,
                 120, what="shard 1 RUNNING and shard 0's total on /metrics")
        live = scrape()
        assert value(live, "fleet_shard_samples_total", shard="0", host="local", gpu="0", run="job") == 30.0
        assert value(live, "fleet_host_up", host="local") == 1.0
        assert sum(v for (n, ls), v in live.items() if n == "fleet_shard_state" and ("shard", "0") in ls) == 1.0
        # The client goes; the run's supervisor serves the figures on, fresh, with nobody attached.
        proc.kill()
        proc.wait(10)
        before = value(scrape(), "fleet_shard_samples_done", shard="0")
        wait_for(lambda: (m := scrape()) and (value(m, "fleet_shard_samples_done", shard="0") or 0) > before + 2, 60,
                 what="the figures moving on with no client")
        wait_for(lambda: supervisor_info(config) is None, 120, what="the run's end, and its supervisor with it")
    finally:
        if proc.poll() is None:
            proc.kill()
    printed = fleet("status", "--prometheus", "-c", config)
    assert printed.returncode == 0, printed.stderr
    samples = parse(printed.stdout)
    snap = json.loads(fleet("status", "--json", "-c", config).stdout)
    assert value(samples, "fleet_finished", run="job") == 1.0 == float(snap["totals"]["finished"])
    assert value(samples, "fleet_samples_total", run="job") == snap["totals"]["total"] == 60
    for s in snap["shards"]:
        labels = dict(shard=str(s["id"]), host=s["host"], gpu=str(s["gpu"]))
        assert value(samples, "fleet_shard_state", state="DONE", **labels) == 1.0
        assert value(samples, "fleet_shard_samples_done", **labels) == s["done"] + s["skipped"]
        assert value(samples, "fleet_shard_restarts", **labels) == s["restarts"]
        assert value(samples, "fleet_shard_tokens_done", **labels) is None        # a [job] counts no tokens


def test_a_metrics_address_that_is_no_host_and_port_is_one_line_and_exit_2(tmp_path):
    from fleet.metrics import AddressError, parse_address
    assert parse_address("127.0.0.1:9400") == ("127.0.0.1", 9400)
    assert parse_address(":9400") == ("127.0.0.1", 9400) and parse_address("[::1]:9400") == ("::1", 9400)
    for bad in ("127.0.0.1:99999", "127.0.0.1:0", "9400", "host:port", "127.0.0.1:"):
        try:
            parse_address(bad)
        except AddressError as e:
            assert bad in str(e) and "\n" not in str(e)
        else:
            raise AssertionError(f"{bad} was taken")
    config = job_toml(tmp_path, {"0": [[["print", "extract-only mode"]]]}, gpus=(0,))
    r = fleet("up", "--headless", "--metrics", "127.0.0.1:99999", "-c", config)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "'127.0.0.1:99999' is not HOST:PORT" in r.stderr
    assert supervisor_info(config) is None                       # refused before anything started
