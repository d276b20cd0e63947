#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs (OpenSSH server, tmux, iproute2 from the
# distribution, the package with its worker and test extras from PyPI), then runs pytest.
# Extra arguments go to pytest. Needs root (or sudo) for apt-get and for the sshd the tests start.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
# sshd for the SSH tests, tmux for the terminal smoke test, iproute2 for the network-namespace hosts.
if ! [ -x /usr/sbin/sshd ] || ! command -v tmux >/dev/null || ! command -v ssh-keygen >/dev/null \
    || ! command -v ip >/dev/null; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-server tmux iproute2 >/dev/null
fi

PY="${PYTHON:-python3}"
# torch is pinned: 2.13.0 is the CPU build; an unpinned torch pulls a multi-GB CUDA build.
"$PY" -m pip install -q --disable-pip-version-check -e '.[worker,test]' torch==2.13.0
# The trainers whose readers the format tests run, without their pins (torch 2.11, sglang, ...):
# only their reader modules are imported, and those need nothing beyond the test extra.
"$PY" -m pip install -q --disable-pip-version-check --no-deps \
    specforge==0.2.0 speculators==0.9.0 hs-connectors==0.9.0
exec "$PY" -m pytest -q "$@"
