"""Faults seen by fleet: a shard that crashes on start (BACKOFF with growing delays, then FATAL,
the others untouched), over-long samples end to end, bad inputs, and property tests that nothing
from fleet.toml is ever run by a shell as code."""

from __future__ import annotations

import json
import os
import re
import shlex
import string
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from fleet.config import FleetSpec, load_config
from fleet.jobs import Placement, shard_command
from tests.conftest import REPO, wait_for
from tests.faults.test_worker_faults import small_tmpfs  # noqa: F401  (the fixture)


def fleet(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fleet.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def events(tmp_path, run: str, shard: int) -> list[dict]:
    path = tmp_path / "fleet" / run / "shards" / str(shard) / "events.jsonl"
    return [json.loads(l) for l in open(path) if l.strip()]


def test_crash_on_start_backs_off_with_growing_delays_then_fatal(tmp_path):
    code = "import sys, time; time.sleep(1); sys.exit(3) if {shard} == 1 else time.sleep(3)"
    (tmp_path / "fleet.toml").write_text(f"""
[run]
name = "crash"
output = "out"

[supervise]
max_restarts = 3
backoff_base = "1s"
backoff_max = "4s"

[job]
command = {json.dumps("{python} -c " + shlex.quote(code))}

[[hosts]]
name = "local"
address = "local"
gpus = [0, 1]
root = "fleet"
""")
    r = fleet("up", "--headless", "-c", str(tmp_path / "fleet.toml"))
    assert r.returncode == 1, r.stdout + r.stderr                      # not every shard is DONE
    assert "shard 1 local:1 RUNNING -> FATAL 0/0 (gave up after 3 restart(s); last: exited with code 3)" in r.stdout
    for delay in ("1s", "2s", "4s"):
        assert f"shard 1 local:1 RUNNING -> BACKOFF 0/0 (exited with code 3; restart in {delay})" in r.stdout
    assert "shard 0 local:0 RUNNING -> DONE" in r.stdout               # a [job] runs once started
    launches = [e for e in events(tmp_path, "crash", 1) if e["event"] == "launch"]
    exits = [e for e in events(tmp_path, "crash", 1) if e["event"] == "exited"]
    assert [e["by"] for e in launches] == ["manual", "auto", "auto", "auto"]
    gaps = [launches[i + 1]["t"] - exits[i]["t"] for i in range(3)]    # exit -> next launch
    assert gaps[0] < gaps[1] < gaps[2], gaps                           # 1 s, 2 s, 4 s
    assert [e["by"] for e in events(tmp_path, "crash", 0) if e["event"] == "launch"] == ["manual"]
    st_ = fleet("status", "--json", "-c", str(tmp_path / "fleet.toml"))
    assert st_.returncode == 1
    assert [s["state"] for s in json.loads(st_.stdout)["shards"]] == ["DONE", "FATAL"]


def test_over_long_samples_end_to_end_through_fleet(tmp_path, dense_model):
    rows = [{"input_ids": [1, 2, 3] * n} for n in (2, 50, 3, 70, 4, 5)]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "fleet.toml").write_text(f"""
[run]
name = "long"
model = {json.dumps(dense_model)}
data = "d.jsonl"
output = "out"
max_length = 100
max_skip_fraction = 0.5                # 2 of 6 rows are meant to be skipped
device = "cpu"

[[hosts]]
name = "local"
address = "local"
gpus = [0, 1]
root = "fleet"
""")
    assert fleet("up", "--headless", "-c", str(tmp_path / "fleet.toml")).returncode == 0
    v = fleet("verify", "-c", str(tmp_path / "fleet.toml"))
    assert v.returncode == 0, v.stdout
    assert "4 written, 2 skipped (33.33%), 6 in the dataset" in v.stdout
    assert "skipped 1: too long: 150 tokens > --max-length 100" in v.stdout
    assert "skipped 3: too long: 210 tokens > --max-length 100" in v.stdout


def test_out_of_memory_end_to_end_through_fleet(tmp_path, dense_model):
    """The real worker under fleet, on a 'GPU' that runs out of memory above 256 tokens a batch:
    batches split, the one sample that never fits is skipped and reported, the run completes."""
    rows = [{"input_ids": [7] * n} for n in [40] * 30 + [300, 20]]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    path = tmp_path / "fleet.toml"

    def write(pythonpath: str) -> None:
        path.write_text(f"""
[run]
name = "oom"
model = {json.dumps(dense_model)}
data = "d.jsonl"
output = "out"
device = "cpu"
max_tokens_per_batch = 4096
max_skip_fraction = 0.1               # the one sample that never fits is 1 of 32
env = {{ PYTHONPATH = {json.dumps(pythonpath)}, FLEET_INJECT_OOM_ABOVE = "256" }}

[[hosts]]
name = "local"
address = "local"
gpus = [0]
root = "fleet"
""")
    # [run] env's PYTHONPATH names only the injection folder: the deployed worker stays importable
    write(os.path.join(os.path.dirname(os.path.abspath(__file__)), "inject"))
    r = fleet("up", "--headless", "-c", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    skipped = [e for e in events(tmp_path, "oom", 0) if e["event"] == "sample_skipped"]
    assert [(e["index"], e["reason"]) for e in skipped] == [(30, "out of GPU memory at 300 tokens (alone, after the rest)")]
    v = fleet("verify", "-c", str(path))
    assert v.returncode == 0 and "31 written, 1 skipped (3.12%), 32 in the dataset" in v.stdout, v.stdout


def test_rows_skipped_for_a_passing_oom_are_retried_by_a_restart_by_hand(tmp_path, dense_model):
    """Memory short for a while (injected until a file goes): too many rows skipped, FATAL with the
    way out in its reason; the cause gone, `fleet restart` retries exactly those rows, and the run
    ends DONE with every row written."""
    rows = [{"input_ids": [7] * n} for n in [40] * 10 + [20] * 10]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    short = tmp_path / "memory-short"
    short.write_text("")
    path = tmp_path / "fleet.toml"
    inject = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inject")
    path.write_text(f"""
[run]
name = "oom2"
model = {json.dumps(dense_model)}
data = "d.jsonl"
output = "out"
device = "cpu"
max_tokens_per_batch = 4096
env = {{ PYTHONPATH = {json.dumps(inject)}, FLEET_INJECT_OOM_ABOVE = "30", FLEET_INJECT_OOM_WHILE = {json.dumps(str(short))} }}

[[hosts]]
name = "local"
address = "local"
gpus = [0]
root = "fleet"
""")
    r = fleet("up", "--headless", "-c", str(path))
    assert r.returncode == 1, r.stdout + r.stderr
    snap = json.loads(fleet("status", "--json", "-c", str(path)).stdout)
    shard = snap["shards"][0]
    assert shard["state"] == "FATAL" and "skipped 10 of 20 rows" in shard["reason"], shard
    assert "10 of them failed alone (out of memory, a GPU error): once the cause is gone, a restart by hand " \
           "(r, or fleet restart) retries them" in shard["reason"], shard["reason"]
    short.unlink()                                     # the memory is back
    r = fleet("restart", "0", "-c", str(path))
    assert r.returncode == 0, r.stdout + r.stderr
    wait_for(lambda: json.loads(fleet("status", "--json", "-c", str(path)).stdout)["shards"][0]["state"] == "DONE",
             180, what="shard 0 DONE after the restart")
    warned = [e["message"] for e in events(tmp_path, "oom2", 0) if e["event"] == "warning"]
    assert any(m.startswith("retrying 10 row(s) skipped for failures that may pass (0-9)") for m in warned), warned
    v = fleet("verify", "-c", str(path))
    assert v.returncode == 0 and "20 written, 0 skipped" in v.stdout, v.stdout


def test_gpu_index_out_of_range_is_refused_by_preflight(tmp_path, dense_model, token_data):
    (tmp_path / "fleet.toml").write_text(f"""
[run]
name = "gpus"
model = {json.dumps(dense_model)}
data = {json.dumps(token_data)}
output = "out"
device = "cuda"

[[hosts]]
name = "local"
address = "local"
gpus = [0, 7]
root = "fleet"
""")
    r = fleet("up", "--headless", "-c", str(tmp_path / "fleet.toml"))
    assert r.returncode == 1
    assert "preflight refused: local: GPU index" in r.stderr and "out of range" in r.stderr


# --- nothing from fleet.toml reaches a shell as code --------------------------------------------

nasty = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
                min_size=1, max_size=40)


def spec_with(model: str, data: str, output: str, root: str, command: str | None = None) -> FleetSpec:
    raw = {"run": {"name": "r", "model": model, "data": data, "output": output},
           "hosts": [{"name": "h", "address": "10.0.0.1", "root": root, "gpus": [0]}]}
    if command is not None:
        raw["job"] = {"command": command}
    return FleetSpec.model_validate(raw)


@settings(max_examples=300, deadline=None)
@given(model=nasty, data=nasty, output=nasty, root=nasty)
def test_paths_survive_the_remote_shell_as_single_arguments(model, data, output, root):
    from fleet.config import Config
    config = Config(spec_with(model, data, output, root), "/x/fleet.toml")
    host = config.hosts[0]
    cmd = shard_command(config, host, Placement(0, "h", 0), 1)
    line = shlex.join(cmd.argv)                   # what SSHTransport sends to the remote shell
    assert shlex.split(line) == cmd.argv          # the shell hands back exactly these arguments
    pairs = list(zip(cmd.argv, cmd.argv[1:]))     # a value may itself read "--out": look for the pair
    assert ("--model", model) in pairs and ("--data", data) in pairs
    assert ("--out", output.replace("{host}", "h")) in pairs


@settings(max_examples=300, deadline=None)
@given(output=nasty, words=st.lists(st.sampled_from(["{python}", "run.py", "--shard", "{shard}", "--out",
                                                      "{output}", "x{gpu}y", "--n={num_shards}"]),
                                    min_size=1, max_size=8))
def test_custom_job_placeholders_never_split_or_execute(output, words):
    from fleet.config import Config
    template = " ".join(words)
    config = Config(spec_with("m", "d", output, "root", command=template), "/x/fleet.toml")
    cmd = shard_command(config, config.hosts[0], Placement(3, "h", 5), 8)
    assert len(cmd.argv) == len(shlex.split(template))       # one word stays one argument
    for word, arg in zip(shlex.split(template), cmd.argv):
        if word == "{output}":
            assert arg == output                              # inserted verbatim, never parsed
    assert shlex.split(shlex.join(cmd.argv)) == cmd.argv


@settings(max_examples=200, deadline=None)
@given(name=st.text(min_size=1, max_size=30))
def test_host_names_are_either_safe_or_refused(name, tmp_path_factory):
    path = tmp_path_factory.mktemp("names") / "fleet.toml"
    path.write_text(f'[run]\nname = "r"\noutput = "o"\nmodel = "m"\ndata = "d"\n\n[[hosts]]\n'
                    f'name = {json.dumps(name)}\naddress = "local"\n')
    try:
        config = load_config(str(path))
    except Exception as e:                                    # refused with a one-line message
        assert type(e).__name__ == "ConfigError" and "\n" not in str(e)
        return
    assert set(config.hosts[0].name) <= set(string.ascii_letters + string.digits + "._-")
    assert not config.hosts[0].name.startswith(("-", "."))


def test_a_record_the_full_disk_cuts_short_is_taken_back_not_torn(tmp_path, small_tmpfs):  # noqa: F811
    """A full state disk (a real 2 MB tmpfs filled to the last byte) cuts a record short: the part
    written is taken back and the writer told (OSError), so the file still ends on a whole line and
    the next record, once there is room, is read — never glued to a torn one."""
    from worker import protocol
    path = os.path.join(small_tmpfs, "events.jsonl")
    protocol.append_jsonl(path, protocol.Launch(launch=1))
    filler = os.path.join(small_tmpfs, "filler")
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    big = protocol.Failed(launch=1, reason="x" * 200_000)        # more than the page's slack
    try:
        protocol.append_jsonl(path, big)
        raise AssertionError("a record larger than the free space was written")
    except OSError:
        pass
    assert open(path, "rb").read().endswith(b"\n")
    os.unlink(filler)
    protocol.append_jsonl(path, protocol.Exited(launch=1, code=0))
    assert [type(e).__name__ for e in protocol.read_events(path)] == ["Launch", "Exited"]


def test_a_dead_gpus_rows_are_done_by_its_hosts_others_and_the_run_finishes(tmp_path, dense_model):
    """Three shards of one host, the shard on GPU 2 dead from its first batch (a sticky CUDA error
    on every launch): the host's other two take its rows over and finish them, and the run ends
    finished, with the move in the records and `fleet verify` exact."""
    from worker.demo import make_token_dataset
    make_token_dataset(str(tmp_path / "d.jsonl"), 180, vocab_size=500, mean_tokens=30, seed=8)
    path = tmp_path / "fleet.toml"
    path.write_text(f"""
[run]
name = "dead"
model = {json.dumps(dense_model)}
data = "d.jsonl"
output = "out"
device = "cpu"
max_tokens_per_batch = 256
env = {{ PYTHONPATH = {json.dumps(os.path.join(os.path.dirname(os.path.abspath(__file__)), "inject"))}, FLEET_INJECT_DEAD_GPU = "2", OMP_NUM_THREADS = "1" }}

[supervise]
max_restarts = 1
backoff_base = "1s"

[[hosts]]
name = "local"
address = "local"
gpus = [0, 1, 2]
root = "fleet"
""")
    r = fleet("up", "--headless", "-c", str(path), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"of local:2 \((FATAL|BACKOFF|FAILED|PENDING|STOPPING|STARTING|LOADING)\) → local:", r.stderr), r.stderr   # the move, a line in the log view
    snap = json.loads(fleet("status", "--json", "-c", str(path)).stdout)
    shards = {s["id"]: s for s in snap["shards"]}
    # GPU 2 ends FATAL, or DONE when its last restart found its host's rows all done (no model load)
    assert [shards[k]["state"] for k in range(2)] == ["DONE", "DONE"] and shards[2]["state"] in ("DONE", "FATAL")
    assert shards[2]["failures"] >= 1 and "CUDA error" in shards[2]["last_failure"]
    assert shards[2]["holds_rows"] is False and shards[2]["rows_moved_out"] > 0 and shards[2]["total"] == 0
    assert shards[0]["rows_moved_in"] + shards[1]["rows_moved_in"] == shards[2]["rows_moved_out"]
    assert snap["totals"]["finished"] is True and snap["totals"]["rows_moved"] == shards[2]["rows_moved_out"]
    assert snap["totals"]["done"] == 180
    assert "rows moved between GPUs" in fleet("status", "-c", str(path)).stdout
    v = fleet("verify", "-c", str(path))
    assert v.returncode == 0 and "180 written" in v.stdout, v.stdout
