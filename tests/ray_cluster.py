"""A real Ray cluster on this machine for the tests, started the way a user starts one: `ray start
--head`, then more nodes with `ray start --address` (distinct ports, each named with --node-name and
advertising logical "GPUs" that the tests' CPU shards take). A node is removed as a machine is lost:
its raylet SIGKILLed, and with it every worker and actor it ran. `stop()` is `ray stop --force`.

Small object stores and no usage stats; one cluster at a time on a machine (the Ray tests are one
xdist group).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from tests.sshd_server import free_port

ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DEDUP_LOGS": "0"}
STORE_BYTES = 80_000_000


class RayClusterError(Exception):
    pass


def ray_bin() -> str:
    path = shutil.which("ray")
    if path is None:
        raise RayClusterError("the `ray` command is not installed (pip install 'ray[default]')")
    return path


@dataclass
class RayCluster:
    port: int
    dashboard_port: int
    nodes: list[str] = field(default_factory=list)
    next_worker_port: int = 21000
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="ray-"))   # its session files

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _start(self, *args: str, hide: str | None = None) -> None:
        """`ray start`; `hide`: a folder this node sees empty (a tmpfs over it in a mount namespace of
        the node's own), as a node whose disk is its own sees another node's local folder."""
        low = self.next_worker_port
        self.next_worker_port += 400
        wrap = [] if hide is None else ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                        'mkdir -p "$0" && mount -t tmpfs fleet-hidden "$0" && shift && exec "$@"',
                                        hide, "--"]
        r = subprocess.run([*wrap, ray_bin(), "start", *args, "--disable-usage-stats",
                            f"--object-store-memory={STORE_BYTES}", f"--min-worker-port={low}",
                            f"--max-worker-port={low + 399}", f"--dashboard-agent-listen-port={free_port()}",
                            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"],
                           capture_output=True, text=True, env=ENV, timeout=180)
        if r.returncode != 0:
            raise RayClusterError(f"ray start {' '.join(args)}: exit {r.returncode}: {r.stderr.strip()[-2000:]}")

    def add_node(self, name: str, gpus: int, cpus: int = 1, hide: str | None = None) -> None:
        self._start(f"--address={self.address}", "--node-ip-address=127.0.0.1", f"--node-name={name}",
                    f"--num-gpus={gpus}", f"--num-cpus={cpus}", f"--node-manager-port={free_port()}",
                    f"--object-manager-port={free_port()}", hide=hide)
        self.nodes.append(name)
        self.wait_nodes()

    def wait_nodes(self, timeout: float = 60) -> None:
        """Until every node started is alive in Ray's own view, and no removed one is."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sorted(self.alive()) == sorted(self.nodes):
                return
            time.sleep(0.5)
        raise RayClusterError(f"Ray's nodes {self.alive()} are not {self.nodes}")

    def alive(self) -> list[str]:
        code = ("import ray, json; ray.init(address=%r, logging_level='ERROR', log_to_driver=False);"
                "print(json.dumps([n['NodeName'] for n in ray.nodes() if n['Alive']]))" % self.address)
        r = subprocess.run([shutil.which("python3") or "python3", "-c", code], capture_output=True, text=True,
                           env=ENV, timeout=120)
        import json
        try:
            return json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return []

    def raylet(self, name: str) -> int | None:
        """The pid of node `name`'s raylet (its command line names the node)."""
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"/raylet") and f"--node-name={name}".encode() in argv:
                return int(pid)
        return None

    def remove_node(self, name: str) -> None:
        """The node lost as a machine is: its raylet killed; its workers and actors die with it."""
        pid = self.raylet(name)
        if pid is None:
            raise RayClusterError(f"no raylet of node {name}")
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
        for p in [pid, *map(int, children)]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.nodes.remove(name)

    def stop(self) -> None:
        subprocess.run([ray_bin(), "stop", "--force"], capture_output=True, env=ENV, timeout=120)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_ray(head_gpus: int = 2, head_cpus: int = 2, tries: int = 2) -> RayCluster:
    """A head node named `head` with `head_gpus` logical GPUs, its dashboard (the state API) on. Its
    session files in a temp folder of its own (not the machine's /tmp/ray). A head whose start fails
    (its dashboard, slow to come up on a loaded machine, reported as gone) is stopped and started
    once more; the second failure is the test's."""
    for attempt in range(tries):
        cluster = RayCluster(free_port(), free_port())
        subprocess.run([ray_bin(), "stop", "--force"], capture_output=True, env=ENV, timeout=120)
        try:
            cluster._start("--head", f"--port={cluster.port}", "--node-ip-address=127.0.0.1", "--node-name=head",
                           f"--num-gpus={head_gpus}", f"--num-cpus={head_cpus}", "--include-dashboard=true",
                           "--dashboard-host=127.0.0.1", f"--dashboard-port={cluster.dashboard_port}",
                           f"--ray-client-server-port={free_port()}", f"--node-manager-port={free_port()}",
                           f"--object-manager-port={free_port()}", f"--temp-dir={cluster.temp_dir}")
            cluster.nodes.append("head")
            cluster.wait_nodes()
            return cluster
        except RayClusterError:
            cluster.stop()
            if attempt == tries - 1:
                raise
        except BaseException:
            cluster.stop()
            raise
    raise RayClusterError("unreachable")
