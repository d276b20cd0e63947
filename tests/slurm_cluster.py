"""A real one-node Slurm cluster on 127.0.0.1 for the tests: Debian's `munge` and `slurm-wlm`
(slurmctld, slurmd), each started in the foreground by the fixture with everything it needs in one
folder — a fresh munge key, munged's socket, a slurm.conf with free ports, state and spool folders,
logs — and stopped by it. Nothing under /etc is read or written: every Slurm command finds the
cluster through SLURM_CONF.

One node `localhost` with `cpus` CPU-only slots (SlurmdParameters=config_overrides, so the count
does not depend on the machine), two partitions on it: `debug` (the default) and `urgent`, whose
jobs preempt debug's (PreemptMode=CANCEL). No accounting storage, so `sacct` is unavailable, as on
many clusters. MinJobAge keeps finished jobs visible to squeue for 300 s.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field

from tests.sshd_server import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmError(Exception):
    pass


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}")
                                       if os.path.exists(p)), None)


@dataclass
class SlurmCluster:
    dir: str
    conf: str
    cpus: int
    node: str = "localhost"
    procs: list = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": self.conf}

    def run(self, *argv: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        r = subprocess.run(list(argv), capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(argv)}: exit {r.returncode}: {r.stderr.strip()}")
        return r

    def jobs(self) -> dict[str, tuple[str, str]]:
        """Every job Slurm lists now: job -> (state, reason)."""
        out = self.run("squeue", "-h", "-r", "-t", "all", "-o", "%i|%T|%r").stdout
        return {j: (st, r) for j, st, r in (l.split("|", 2) for l in out.splitlines() if l.strip())}

    def live_jobs(self) -> list[str]:
        final = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "BOOT_FAIL",
                 "DEADLINE", "OUT_OF_MEMORY"}
        return [j for j, (st, _) in self.jobs().items() if st not in final]

    def node_state(self) -> str:
        return self.run("sinfo", "-h", "-n", self.node, "-o", "%T").stdout.strip().splitlines()[0]

    def idle(self, timeout: float = 60) -> None:
        """Cancel every job and wait until the node is idle again (between tests)."""
        self.run("scancel", "--user", "root", check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.live_jobs() and self.node_state().rstrip("*") == "idle":
                return
            time.sleep(0.2)
        raise SlurmError(f"node not idle after {timeout:.0f}s: {self.node_state()}, jobs {self.jobs()}")

    def stop(self) -> None:
        self.run("scancel", "--user", "root", check=False)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def unreachable_conf(self, path: str) -> str:
        """This cluster's slurm.conf with its controller on a port nothing listens on (and short
        timeouts): every Slurm command that reads it fails as with slurmctld down."""
        text = open(self.conf).read()
        lines = [l for l in text.splitlines() if not l.startswith("SlurmctldPort=")]
        with open(path, "w") as f:
            f.write("\n".join(lines + [f"SlurmctldPort={free_port()}", "MessageTimeout=1", "TCPTimeout=1"]) + "\n")
        return path

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = os.path.join(self.dir, name)
            if os.path.exists(path):
                out.append(f"--- {name}\n" + "".join(open(path, errors="replace").readlines()[-30:]))
        return "\n".join(out)


def slurm_conf(d: str, cpus: int, ctld_port: int, slurmd_port: int) -> str:
    host = socket.gethostname().split(".")[0]
    return f"""# written by tests/slurm_cluster.py
ClusterName=fleettest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge.socket
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SlurmdParameters=config_overrides
ReturnToService=1
KillWait=5
MinJobAge=300
InactiveLimit=0
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=urgent Nodes=localhost MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


def _wait(what: str, predicate, cluster: SlurmCluster, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc, name in zip(cluster.procs, DAEMONS):
            if proc.poll() is not None:
                raise SlurmError(f"{name} exited ({proc.returncode}) while waiting for {what}\n{cluster.logs()}")
        try:
            if predicate():
                return
        except (SlurmError, OSError, IndexError):
            pass
        time.sleep(0.2)
    raise SlurmError(f"timed out waiting for {what}\n{cluster.logs()}")


def start_slurm(d: str, cpus: int = 2) -> SlurmCluster:
    """munged, slurmctld and slurmd in `d`, up and the node idle; stop() ends them."""
    missing = [n for n in (*DAEMONS, "sbatch", "squeue", "scancel", "scontrol", "sinfo") if not _which(n)]
    if missing:
        raise SlurmError(f"{', '.join(missing)} not installed: scripts/test.sh installs slurm-wlm and munge")
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o755)
    for sub in ("state", "spool"):
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    key = os.path.join(d, "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o600)
    conf = os.path.join(d, "slurm.conf")
    with open(conf, "w") as f:
        f.write(slurm_conf(d, cpus, free_port(), free_port()))
    cluster = SlurmCluster(d, conf, cpus)
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=cluster.env)
    try:
        cluster.procs.append(subprocess.Popen(
            [_which("munged"), "-F", "--force", f"--key-file={key}", f"--socket={d}/munge.socket",
             f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
            **quiet))
        _wait("munged's socket", lambda: os.path.exists(f"{d}/munge.socket"), cluster)
        cluster.procs.append(subprocess.Popen([_which("slurmctld"), "-D", "-c", "-i", "-f", conf], **quiet))
        _wait("slurmctld", lambda: "UP" in cluster.run("scontrol", "ping").stdout, cluster)
        cluster.procs.append(subprocess.Popen([_which("slurmd"), "-D", "-N", "localhost", "-f", conf], **quiet))
        _wait("the node to be idle", lambda: cluster.node_state().rstrip("*") == "idle", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster
