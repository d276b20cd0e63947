#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs (OpenSSH server, tmux, iproute2, Slurm
# and munge from the distribution, the package with its worker and test extras from PyPI), then runs pytest.
# Extra arguments go to pytest. Needs root (or sudo) for apt-get and for the sshd and Slurm the tests start.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
# sshd for the SSH tests, tmux for the terminal smoke test, iproute2 for the network-namespace hosts,
# slurm-wlm (slurmctld, slurmd, sbatch/squeue/scancel) and munge (Slurm's authentication) for the tests
# of Slurm as the launcher. Nothing is configured here: tests/slurm_cluster.py writes its own slurm.conf
# and munge key into a temp folder and starts and stops munged, slurmctld and slurmd itself.
if ! [ -x /usr/sbin/sshd ] || ! command -v tmux >/dev/null || ! command -v ssh-keygen >/dev/null \
    || ! command -v ip >/dev/null || ! [ -x /usr/sbin/slurmctld ] || ! [ -x /usr/sbin/slurmd ] \
    || ! [ -x /usr/sbin/munged ] || ! command -v sbatch >/dev/null; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-server tmux iproute2 slurm-wlm munge >/dev/null
fi

# A pyenv rehash lock left behind by a rehash that was killed (found on fresh machines here): every
# `pip install` through pyenv's shim and every login shell's `pyenv init` (so every command the SSH
# tests run through sshd) waits 60 s on it, then goes on or fails. A rehash holds it for well under a
# second (the ones waiting do not hold it): older than a minute, it is stale.
lock="${PYENV_ROOT:-$HOME/.pyenv}/shims/.pyenv-shim"
[ -f "$lock" ] && find "$lock" -mmin +1 -delete
# The suite starts ~2,000 Python processes (workers, agents, the CLI, each over a fresh deployed copy):
# with bytecode written once (__pycache__, ignored by git and by deploy), each imports fleet's and
# the worker's modules without compiling them again (0.1-0.2 s a process on this machine).
unset PYTHONDONTWRITEBYTECODE
# The interpreter itself, not a version manager's shim (pyenv's runs a rehash after every pip install).
PY="$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')"
export PATH="$(dirname "$PY"):$PATH"
# torch is pinned: 2.13.0 is the CPU build; an unpinned torch pulls a multi-GB CUDA build. The test
# extra brings ray[default]: tests/ray_cluster.py starts its own Ray nodes with `ray start` (and stops
# them), as it starts sshd and Slurm; mypy and its stubs for tests/test_types.py.
"$PY" -m pip install -q --disable-pip-version-check -e '.[worker,test]' torch==2.13.0
# The trainers whose readers the format tests run, without their pins (torch 2.11, sglang, ...):
# only their reader modules are imported, and those need nothing beyond the test extra.
"$PY" -m pip install -q --disable-pip-version-check --no-deps \
    specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
# Three test processes (pytest-xdist): most tests wait on real subprocesses and servers, so three
# keep 2 cores busy; --dist loadgroup keeps the Slurm tests on one process with one cluster, and the
# Ray tests on one with one cluster at a time. A test process that dies ends the run at once, naming
# the test (--max-worker-restart=0): loadgroup never hands a dead process's tests to its
# replacement, and the run would hang to CI's limit.
exec "$PY" -m pytest -q -n 3 --dist loadgroup --max-worker-restart=0 --durations=30 "$@"
