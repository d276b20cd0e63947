"""Shared fixtures: tiny real models saved with save_pretrained, a locally trained tokenizer, datasets.

Nothing is mocked: the models are real transformers models with random weights, run on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH sshd on 127.0.0.1 (tests/sshd_server.py), for the whole session."""
    from tests.sshd_server import SshdError, start_sshd
    try:
        server, proc = start_sshd(str(tmp_path_factory.mktemp("sshd")))
    except SshdError as e:
        pytest.fail(str(e))
    yield server
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real one-node Slurm (munged, slurmctld, slurmd; tests/slurm_cluster.py) for the whole
    session; SLURM_CONF points every Slurm command (and fleet's) at it."""
    from tests.slurm_cluster import SlurmError, start_slurm
    try:
        cluster = start_slurm(str(tmp_path_factory.mktemp("slurm")))
    except SlurmError as e:
        pytest.fail(str(e))
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster.conf
    yield cluster
    if before is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = before
    cluster.stop()


@pytest.fixture
def slurm(slurm_cluster):
    """The cluster with no job and its node idle, before and after the test."""
    slurm_cluster.run("scontrol", "update", "NodeName=localhost", "State=RESUME", check=False)
    slurm_cluster.idle()
    yield slurm_cluster
    slurm_cluster.run("scontrol", "update", "NodeName=localhost", "State=RESUME", check=False)
    slurm_cluster.idle()


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """{'qwen3': dir, 'qwen3_5_text': dir}: 8 layers, hidden 64, with tokenizer + chat template."""
    from worker.demo import make_model
    root = tmp_path_factory.mktemp("models")
    return {arch: make_model(str(root / arch), arch=arch) for arch in ("qwen3", "qwen3_5_text")}


@pytest.fixture(scope="session")
def dense_model(models):
    return models["qwen3"]


@pytest.fixture(scope="session")
def chat_data(tmp_path_factory):
    from worker.demo import make_chat_dataset
    return make_chat_dataset(str(tmp_path_factory.mktemp("data") / "chat.jsonl"), 40, mean_words=30)


@pytest.fixture(scope="session")
def token_data(tmp_path_factory):
    from worker.demo import make_token_dataset
    return make_token_dataset(str(tmp_path_factory.mktemp("tokdata") / "tok.jsonl"), 60, vocab_size=500,
                              mean_tokens=40, seed=3)


def run_worker(*args: str, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "worker.extract", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, **kw)


def read_events(state_dir: str) -> list[dict]:
    path = os.path.join(state_dir, "events.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if l.strip()]


def wait_for(predicate, timeout: float = 60, interval: float = 0.1, what: str = "condition"):
    """Poll until predicate() is truthy; fail the test naming `what` otherwise (not a timing test)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")
