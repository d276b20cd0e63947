"""The worker as it travels to a host: its files (worker/**/*.py), their hash, the tarball deploy
uploads, and the folder a host keeps them in (`<root>/<run>/code/<hash>/`, so a redeploy never
changes code under a running process). Every module that names the deployed code reads it here
(deploy uploads it; jobs and an engine's submission put it on PYTHONPATH)."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from functools import cache

import worker

from .config import Config, HostSpec

WORKER_DIR = os.path.dirname(os.path.abspath(worker.__file__))


def worker_files() -> list[str]:
    """What travels to the hosts: worker/*.py and its packages' (worker/engine/*.py), as paths
    relative to worker/."""
    out = []
    for folder, dirs, files in os.walk(WORKER_DIR):
        dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
        rel = os.path.relpath(folder, WORKER_DIR)
        out += [f if rel == "." else f"{rel}/{f}" for f in files if f.endswith(".py")]
    return sorted(out)


@cache
def worker_hash() -> str:
    digest = hashlib.sha256()
    for name in worker_files():
        digest.update(name.encode() + b"\0")
        with open(os.path.join(WORKER_DIR, name), "rb") as f:
            digest.update(f.read() + b"\0")
    return digest.hexdigest()[:16]


def code_dir(config: Config, host: HostSpec) -> str:
    return os.path.join(config.run_dir(host), "code", worker_hash())


def worker_tarball() -> bytes:
    """worker_files() as a gzip'd tar whose top folder is `worker/`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in worker_files():
            tar.add(os.path.join(WORKER_DIR, name), arcname=f"worker/{name}")
    return buf.getvalue()
