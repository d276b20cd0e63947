"""Shared fixtures: tiny real models saved with save_pretrained, a locally trained tokenizer, datasets.

Nothing is mocked: the models are real transformers models with random weights, run on the CPU.
"""

from __future__ import annotations

import glob
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


def host_python() -> str:
    """The `python` of the tests' SSH hosts: this interpreter without this checkout's fleet and
    worker (tests/host_python.py), so a command must find the worker fleet deployed there."""
    import shlex
    import tempfile
    path = os.path.join(tempfile.gettempdir(), f"fleet-host-python-{os.getpid()}")
    if not os.path.exists(path):
        script = os.path.join(REPO, "tests", "host_python.py")
        with open(path + ".tmp", "w") as f:
            f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(script)} "$@"\n')
        os.chmod(path + ".tmp", 0o755)
        os.replace(path + ".tmp", path)
    return path


# --- the fast lane: `pytest -m "not slow"` (README: Development) ----------------------------------
# What is slow is said here, in one place, with why; CI (scripts/test.sh) runs everything. The fast
# lane keeps the pure parts, the live view on the synthetic fleet, and a short worker run.
SLOW_MARKERS = {"ssh": "a real sshd", "slurm": "a real one-node Slurm cluster", "ray": "a real Ray cluster"}
SLOW_FIXTURES = {
    "runs": "the worker run in every format on the tiny model (minutes, shared by a session)",
    "fp8_run": "a worker run in fp8 and speculators' train loop on it",
}
SHARED_RUNS = ("runs", "compile_runs", "fp8_run")   # session/module fixtures that are whole worker runs
SLOW_MODULES = {
    "tests/fleet/test_actions.py": "every stop and restart with real runners over many cycles",
    "tests/faults/test_clock.py": "a wall clock stepped under real shards, watched for twice the stall timeout",
    "tests/faults/test_fleet_faults.py": "crashes, hangs and lost hosts under the real supervisor",
    "tests/faults/test_netns.py": "hosts behind network namespaces",
    "tests/faults/test_worker_faults.py": "the worker killed, starved and filled up mid-run",
    "tests/trainers/test_specforge.py": "SpecForge's train loop on the worker's output",
    "tests/trainers/test_speculators.py": "speculators' train loop on the worker's output",
    "tests/faults/test_hostile_inputs.py": "hostile disks, logs, pythons and paths through fleet's commands",
    "tests/trainers/test_limits.py": "worker runs judged against SpecForge's and speculators' own limits",
    "tests/worker/test_bench_fp8.py": "the fp8 benchmark on the CPU",
    "tests/worker/test_fp8.py": "worker runs in fp8: resumed, repaired, exported, refused",
    "tests/worker/test_truthful.py": "a worker run (or two) for each refusal and repair",
    "tests/worker/test_multi_gpu.py": "several worker processes sharing the CPU as GPUs",
    "tests/worker/test_speed_paths.py": "the compiled and eager paths compared over whole runs",
    "tests/worker/test_ship.py": "worker runs shipping into a real S3 store that is killed and restarted",
    "tests/fleet/test_destination.py": "fleet up over two sshds into a real S3 store; refusals at preflight",
}
SLOW_TESTS = {
    "tests/fleet/test_job_rows.py::test_a_lost_hosts_rows_are_finished_by_the_other_host_and_it_stops_them_once_back":
        "two hosts over two sshds, one cut off and back, a [job] run per chunk",
    "tests/worker/test_leases.py::test_rows_adopted_while_the_pool_runs_are_done_by_it_once":
        "two worker processes adopting a lost host's rows",
    "tests/worker/test_leases.py::test_rows_revoked_from_a_host_back_from_lost_stop_its_running_shards_and_its_copies_go":
        "two worker processes whose rows are revoked",
    "tests/fleet/test_relocate.py::test_a_lost_hosts_rows_are_finished_by_the_other_and_its_copies_removed_once_it_is_back":
        "two hosts over two sshds, one cut off and back, four worker processes",
    "tests/worker/test_leases.py::test_a_dead_gpus_rows_are_finished_by_the_others_exactly_once":
        "three worker processes sharing one host's rows",
    "tests/worker/test_leases.py::test_a_slow_gpus_last_rows_are_split_off_and_done_once":
        "three worker processes sharing one host's rows, one slowed",
    "tests/fleet/test_figures.py::test_the_run_eta_of_a_host_sharing_its_rows_is_the_pools_not_its_slowest_shards":
        "three worker processes sharing one host's rows, one slowed, replayed into a snapshot",
    "tests/fleet/test_footprint.py::test_fleet_up_projects_the_output_refuses_what_cannot_fit_and_allow_partial_lets_it_through":
        "fleet up with real workers, three times",
    "tests/fleet/test_tui.py::test_live_tui_kill_stop_restart_filter_then_reattach_to_the_finish":
        "the live view on a real supervisor and workers, to the finish",
    "tests/fleet/test_tui.py::test_tmux_smoke_real_terminal_at_80x24": "fleet up in a real terminal, to a restart",
    # A worker run each (test_extract.py keeps one, test_files_manifest_meta_and_no_padding, in the fast lane).
    "tests/worker/test_extract.py::test_batched_equals_one_at_a_time": "a worker run per batch size and model",
    "tests/worker/test_extract.py::test_sharded_runs_cover_the_dataset_and_resume_across_shard_counts":
        "worker runs over two shard counts",
    "tests/worker/test_extract.py::test_sigkill_mid_run_then_resume_ends_complete": "a worker killed and resumed",
    "tests/worker/test_extract.py::test_malformed_rows_are_skipped_and_reported": "a worker run",
    "tests/worker/test_extract.py::test_too_long_samples": "a worker run per mode",
    "tests/worker/test_extract.py::test_raw_chats_assistant_content_mask": "a worker run per chat form",
    "tests/worker/test_extract.py::test_parquet_and_save_to_disk_inputs": "a worker run per input kind",
    "tests/worker/test_extract.py::test_user_errors_are_one_line_with_exit_2": "a worker start per wrong input",
    "tests/worker/test_extract.py::test_speculators_layout_output_inside_the_dataset_folder_over_two_shards_and_a_restart":
        "three worker runs",
    "tests/worker/test_extract.py::test_hybrid_warns_about_missing_fast_kernels": "a worker run on the hybrid model",
    "tests/worker/test_data.py::test_worker_masks_chats_and_skips_unsupervised_samples": "a worker run",
    "tests/worker/test_data.py::test_worker_writes_every_tool_and_thinking_chat": "worker runs per template",
    "tests/worker/test_layers.py::test_preflight_refuses_what_the_worker_would": "preflight and the worker per case",
    "tests/worker/test_sizing.py::test_worker_sends_total_tokens_equal_to_what_it_writes": "a worker run",
}


def _slow_reason(item) -> str | None:
    path = os.path.relpath(str(item.path), REPO)
    for marker, why in SLOW_MARKERS.items():
        if item.get_closest_marker(marker):
            return why
    for fixture, why in SLOW_FIXTURES.items():
        if fixture in item.fixturenames:
            return why
    return SLOW_MODULES.get(path) or SLOW_TESTS.get(f"{path}::{item.originalname}")


@pytest.hookimpl(tryfirst=True)       # before xdist's, which names each item's group from these marks
def pytest_collection_modifyitems(config, items):
    modules = {}
    for item in items:
        modules[os.path.relpath(str(item.path), REPO)] = getattr(item, "module", None)
        if _slow_reason(item):
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slurm"):
            # One Slurm cluster per session: its tests go to one xdist worker (`--dist loadgroup`),
            # where the session fixture starts it once; other workers never start one.
            item.add_marker(pytest.mark.xdist_group("slurm"))
        if item.get_closest_marker("ray"):
            # One Ray cluster at a time on the machine (`ray stop` ends every one): one worker.
            item.add_marker(pytest.mark.xdist_group("ray"))
        for fixture in SHARED_RUNS:
            # Built once a process: the tests that read it go to one process, which builds it once
            # (on three processes it was built three times, a minute and a half of CPU each).
            if fixture in item.fixturenames:
                item.add_marker(pytest.mark.xdist_group(fixture))
    stale = [t for t in SLOW_TESTS if (m := modules.get(t.split("::")[0])) is not None
             and not hasattr(m, t.split("::")[1])]
    if stale:              # a renamed test would leave the list silently: say so
        raise pytest.UsageError(f"tests/conftest.py SLOW_TESTS names tests that do not exist: {stale}")


@pytest.fixture(autouse=True)
def supervisors(tmp_path_factory, monkeypatch):
    """Each test's run supervisors (fleet/service.py, started in the background by `fleet up`) keep
    their sockets, logs and locks in a folder of the test's own ($FLEET_STATE_DIR), and any still
    running when the test ends is stopped (SIGTERM, then SIGKILL): none outlives its test."""
    root = tmp_path_factory.mktemp("fleet-state")
    monkeypatch.setenv("FLEET_STATE_DIR", str(root))
    yield root
    stop_supervisors(root)


@pytest.fixture(autouse=True)
def no_ray_driver():
    """No test leaves its process a driver of a Ray cluster: Ray ends a driver whose cluster has gone
    (a minute after the cluster's stop, with _exit), which took down whichever xdist worker ran the
    test, in another test, and hung `--dist loadgroup` for good. Ask Ray from a subprocess."""
    yield
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
        pytest.fail("this test made the test process a Ray driver (ray.init): ask Ray from a subprocess")


def supervisor_pids(root) -> list[int]:
    """The pids of the supervisors whose folders are under `root` and that still hold their lock."""
    from fleet.runhome import lock_held
    pids = []
    for info in glob.glob(os.path.join(str(root), "*", "supervisor.json")):
        try:
            pid = json.load(open(info))["pid"]
        except (OSError, ValueError, KeyError):
            continue
        if lock_held(os.path.join(os.path.dirname(info), "supervisor.lock")):
            pids.append(int(pid))
    return pids


def stop_supervisors(root) -> None:
    import signal
    pids = supervisor_pids(root)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + 15
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.1)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:                                   # a zombie of ours: reap it
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


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
