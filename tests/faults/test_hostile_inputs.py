"""The smaller ways a careless user or a hostile host broke fleet, each through the real code path:
unusable identity files, logs that are not UTF-8, a full disk at meta.json, a custom job's giant
unterminated log line, preflight's blind spots, a broken python or root taken for an unreachable
host."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, run_worker
from tests.faults.test_worker_faults import small_tmpfs  # noqa: F401  (fixture)
from tests.fleet.conftest import fleet, fleet_toml
from worker import protocol
from worker.sentinels import MAX_LINE, LogWatcher, SentinelSpec


def local_toml(tmp_path, body: str, host: str = "") -> str:
    (tmp_path / "fleet.toml").write_text(body + f"""
[[hosts]]
name = "local"
address = "local"
gpus = [0]
root = "fleet"
{host}
""")
    return str(tmp_path / "fleet.toml")


@pytest.mark.ssh
def test_an_encrypted_or_garbage_identity_file_is_one_line(tmp_path, sshd):
    encrypted = tmp_path / "enc_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(encrypted)], check=True)
    garbage = tmp_path / "garbage_key"
    garbage.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot a key\n-----END OPENSSH PRIVATE KEY-----\n")
    for key, words in ((encrypted, "ssh-add"), (garbage, "cannot be used")):
        config = fleet_toml(tmp_path, model=None, data=None, port=sshd.port, client_key=str(key),
                            known_hosts=sshd.known_hosts, job='[job]\ncommand = "true"')
        for args in (("status",), ("up", "--headless")):
            r = fleet(*args, "-c", config)
            assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
            assert f"identity_file {key} cannot be used" in r.stdout + r.stderr and words in r.stdout + r.stderr


@pytest.mark.ssh
def test_logs_with_bytes_that_are_not_utf8_print_over_ssh(tmp_path, sshd):
    script = tmp_path / "noisy.py"
    script.write_text("import sys\nsys.stdout.buffer.write(b'before \\xff\\xfe bytes\\nafter\\n')\n")
    config = fleet_toml(tmp_path, model=None, data=None, port=sshd.port, client_key=sshd.client_key,
                        known_hosts=sshd.known_hosts, gpus=(0,), job=f'[job]\ncommand = "{{python}} {script}"')
    assert fleet("up", "--headless", "-c", config).returncode == 0
    r = fleet("logs", "0", "-c", config)
    assert r.returncode == 0 and "before \ufffd\ufffd bytes" in r.stdout and "after" in r.stdout
    follow = subprocess.Popen([sys.executable, "-m", "fleet.cli", "logs", "0", "-f", "-c", config], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = "".join(follow.stdout.readline() for _ in range(3))      # the runner's marker, then the job's
        assert "── fleet:" in first and "before \ufffd\ufffd bytes" in first and "after" in first
        assert follow.poll() is None                                  # still following, no traceback
    finally:
        follow.kill()
        follow.wait(10)


def test_a_full_disk_at_meta_json_is_one_line_and_leaves_no_temp_file(tmp_path, dense_model, small_tmpfs):  # noqa: F811
    rows = tmp_path / "d.jsonl"
    rows.write_text("\n".join(json.dumps({"input_ids": [1, 2, 3]}) for _ in range(4)) + "\n")
    out = os.path.join(small_tmpfs, "out")
    os.makedirs(out)
    fd = os.open(os.path.join(small_tmpfs, "filler"), os.O_WRONLY | os.O_CREAT)
    try:                                                             # fill the disk to the last byte
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)
    r = run_worker("--model", dense_model, "--data", str(rows), "--out", out)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"disk full writing {out}/meta.json" in r.stderr, r.stderr
    assert os.listdir(out) == [".fleet"]                 # the shard's lock; no temp file, no data


def test_a_giant_unterminated_log_line_is_read_once_and_bounded(tmp_path):
    """The runner follows a [job]'s log: a line with no end is read once, in bounded chunks, and
    matched on its tail; a \\r-redrawn progress bar counts."""
    log = tmp_path / "log"
    with open(log, "wb") as f:
        f.write(b"x" * (20 << 20))                                  # 20 MiB, no newline
    w = LogWatcher(SentinelSpec(fail="ERROR", progress=r"processed (?P<done>\d+)/(?P<total>\d+)"),
                   str(log), 0, launch=1, shard=0)
    assert w.poll() == [] and w.offset == 20 << 20 and len(w.partial) <= MAX_LINE
    assert w.poll() == [] and w.offset == 20 << 20                  # nothing read twice
    with open(log, "ab") as f:
        f.write(b" ERROR at the end\rprocessed 3/9\r")
    events = w.poll(final=True)
    assert [type(e) for e in events] == [protocol.Sentinel, protocol.Progress]
    assert events[0].line.endswith("ERROR at the end") and (events[1].done, events[1].total) == (3, 9)


def test_preflight_refuses_layers_out_of_range_and_over_long_path_names(tmp_path, dense_model, token_data):
    long = "x" * 300
    config = local_toml(tmp_path, f"""
[run]
name = "pf"
model = {json.dumps(dense_model)}
data = {json.dumps(token_data)}
output = "out/{long}"
layers = [1, 99]
device = "cpu"
""")
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "layer id 99 out of range" in r.stderr and "a folder name is 300 bytes long" in r.stderr


def test_a_broken_python_or_an_unwritable_root_is_a_refusal_not_an_unreachable_host(tmp_path):
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'python: error while loading shared libraries' >&2\nexit 127\n")
    broken.chmod(0o755)
    job = '\n[job]\ncommand = "true"\n'
    config = local_toml(tmp_path, '[run]\nname = "b"\noutput = "out"\n' + job, f"python = {json.dumps(str(broken))}")
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode == 1, r.stderr
    assert "preflight refused: local:" in r.stderr and "shared libraries" in r.stderr
    assert "unreachable" not in r.stderr.lower()
    r = fleet("status", "-c", config)               # status says what the host is: reached, not usable
    assert r.returncode == 3 and "host local: unusable (upload to " in r.stdout, r.stdout   # the worker it needs
    assert "shared libraries" in r.stdout and "UNKNOWN" not in r.stdout
    assert json.loads(fleet("status", "--json", "-c", config).stdout)["hosts"][0]["unusable"] is True
    (tmp_path / "a-file").write_text("")
    config = local_toml(tmp_path, '[run]\nname = "b"\noutput = "out"\n' + job).replace("", "")
    text = open(config).read().replace('root = "fleet"', f'root = {json.dumps(str(tmp_path / "a-file" / "root"))}')
    open(config, "w").write(text)
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode == 1 and "preflight refused: local: upload to" in r.stderr, r.stderr
    assert "NotADirectoryError" in r.stderr and "Traceback" not in r.stderr


def test_a_root_under_proc_is_not_a_missing_python(tmp_path):
    job = '\n[job]\ncommand = "true"\n'
    config = local_toml(tmp_path, '[run]\nname = "b"\noutput = "out"\n' + job)
    text = open(config).read().replace('root = "fleet"', 'root = "/proc/self/fleet-root"')
    open(config, "w").write(text)
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode == 1 and "preflight refused: local: upload to /proc/self/fleet-root" in r.stderr, r.stderr
    assert "not found (set python" not in r.stderr and "Traceback" not in r.stderr


def test_fleet_logs_strips_terminal_escapes_and_a_superscript_shard_is_one_line(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("print('start\\x1b]0;pwned\\x07 \\x1b[2Jcleared \\x1b[31mred\\x1b[0m end', flush=True)\n")
    job = f'\n[job]\ncommand = "{sys.executable} {script}"\n'
    config = local_toml(tmp_path, '[run]\nname = "e"\noutput = "out"\n' + job)
    assert fleet("up", "--headless", "-c", config).returncode == 0
    r = fleet("logs", "0", "-c", config)
    assert r.returncode == 0 and "start cleared red end" in r.stdout, r.stdout
    assert "\x1b" not in r.stdout and "\x07" not in r.stdout
    r = fleet("logs", "\u00b9", "-c", config)
    assert r.returncode == 2 and "no shard '\u00b9'" in r.stderr and "Traceback" not in r.stderr, r.stderr


HOSTILE = "\x1b]52;c;cHduZWQ=\x07\x1b]0;PWNED\x07\x1b[2J\x9d0;x\x9c\u202eevil"


def unprintable(text: str) -> list[str]:
    """The terminal controls and bidi overrides in `text` (an independent statement of the rule:
    C0 but tab and newline, DEL, C1, U+200E/F, U+202A-E, U+2066-9)."""
    return [c for c in text if (ord(c) < 32 and c not in "\t\n") or 0x7f <= ord(c) <= 0x9f
            or c in "\u200e\u200f\u061c" or 0x202a <= ord(c) <= 0x202e or 0x2066 <= ord(c) <= 0x2069]


def test_a_hosts_bytes_never_drive_the_terminal_and_a_long_fail_line_keeps_what_failed(tmp_path):
    """A [job]'s fail lines carrying OSC 52 (clipboard), OSC 0 (title), CSI 2J, a C1 OSC and a
    bidi override (and one preceded by 5,000 characters): up --headless, status, status --json,
    logs print none of them, and the reason names the exception."""
    script = tmp_path / "job.py"
    script.write_text(f"import sys\nprint({'Z' * 5000 + ' ValueError: bad row ' + HOSTILE!r}, flush=True)\n"
                      "sys.exit(1)\n")
    job = f'\n[job]\ncommand = "{sys.executable} {script}"\nfail = "Error"\n'
    config = local_toml(tmp_path, '[run]\nname = "h"\noutput = "out"\n' + job + '\n[supervise]\nmax_restarts = 0\n')
    outputs = {"up": fleet("up", "--headless", "-c", config, timeout=300)}
    outputs["status"] = fleet("status", "-c", config)
    outputs["json"] = fleet("status", "--json", "-c", config)
    outputs["logs"] = fleet("logs", "0", "-c", config)
    for name, r in outputs.items():
        assert unprintable(r.stdout + r.stderr) == [], (name, r.stdout + r.stderr)
    assert "fail sentinel: ValueError: bad row" in outputs["status"].stdout, outputs["status"].stdout
    snap = json.loads(outputs["json"].stdout)
    reason = snap["shards"][0]["last_failure"]
    assert reason.startswith("fail sentinel: ValueError: bad row") and unprintable(reason) == []
    assert "ZZZZ ValueError: bad row" in outputs["logs"].stdout          # the log itself, made printable


@pytest.mark.parametrize("case", ["model", "data folder", "root", "inside another run", "above another run",
                                  "destination is the output"])
def test_a_folder_that_would_mix_two_runs_or_write_among_the_weights_is_refused(tmp_path, dense_model, case):
    """One run per folder: an output that is the model folder, the folder holding the data, the
    file system's root, inside or above another run's output (its owner file, as the worker writes
    it), or a destination that is the output, is refused at preflight with both names."""
    from worker.demo import make_token_dataset
    from worker.writer import claim_output
    (tmp_path / "data").mkdir()
    data = make_token_dataset(str(tmp_path / "data" / "d.jsonl"), 20, vocab_size=500, mean_tokens=10, seed=2)
    other = tmp_path / "runs" / "other"
    claim_output(str(other), "other", 1.0, 0).close()           # another run's output, as its worker claims it
    output, extra = {"model": (dense_model, ""), "data folder": (str(tmp_path / "data"), ""),
                     "root": ("/", ""), "inside another run": (str(other / "mine"), ""),
                     "above another run": (str(tmp_path / "runs"), ""),
                     "destination is the output": (str(tmp_path / "out"),
                                                   f'destination = {json.dumps(str(tmp_path / "out"))}')}[case]
    says = {"model": f"output {output} is the model folder {dense_model}",
            "data folder": f"output {output} is the data's folder {tmp_path / 'data'}",
            "root": "output / is the root of the file system",
            "inside another run": f"output {output} is inside run 'other''s output {other}",
            "above another run": f"output {output} holds run 'other''s output {other}",
            "destination is the output": f"destination {output} is the run's output {output}"}[case]
    config = local_toml(tmp_path, f"""[run]
name = "mine"
model = {json.dumps(dense_model)}
data = {json.dumps(data)}
output = {json.dumps(output)}
device = "cpu"
{extra}
""")
    r = fleet("up", "--headless", "-c", config, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert says in r.stderr.splitlines()[-1], r.stderr
    assert not (tmp_path / "fleet" / "mine" / "shards").exists()


def test_one_machine_listed_twice_with_the_same_gpu_is_refused(tmp_path, dense_model):
    """Two names for one machine (one root: one host id) both given GPU 0: refused before any
    launch, naming both."""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "d.jsonl"), 20, vocab_size=500, mean_tokens=10, seed=2)
    config = local_toml(tmp_path, f"""[run]
name = "twice"
model = {json.dumps(dense_model)}
data = {json.dumps(data)}
output = "out"
device = "cpu"

[[hosts]]
name = "again"
address = "local"
gpus = [0]
root = "fleet"
""")
    r = fleet("up", "--headless", "-c", config, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "error: again and local are one machine: GPU 0 (host id " in r.stderr and "would run two shards" in r.stderr, r.stderr[-300:]
    assert not (tmp_path / "fleet" / "twice" / "shards").exists()


@pytest.mark.parametrize("which", ["data", "config.json"])
def test_a_pipe_for_data_or_the_models_config_is_refused_at_preflight_not_read(tmp_path, dense_model, which):
    """A FIFO nobody writes (the data, or the model's config.json): preflight refuses it in one line
    naming it, at once, where it used to hang reading it."""
    import shutil
    model = str(tmp_path / "model")
    shutil.copytree(dense_model, model)
    data = str(tmp_path / "fifo")
    if which == "data":
        os.mkfifo(data)
    else:
        from worker.demo import make_token_dataset
        data = make_token_dataset(str(tmp_path / "d.jsonl"), 20, vocab_size=500, mean_tokens=10, seed=2)
        os.unlink(os.path.join(model, "config.json"))
        os.mkfifo(os.path.join(model, "config.json"))
    config = local_toml(tmp_path, f"""[run]
name = "p"
model = {json.dumps(model)}
data = {json.dumps(data)}
output = "out"
device = "cpu"
""")
    r = fleet("up", "--headless", "-c", config, timeout=120)
    path = data if which == "data" else os.path.join(model, "config.json")
    label = "data path" if which == "data" else "model config"
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"local: {label} {path} is not a regular file or folder" in r.stderr.splitlines()[-1], r.stderr


def test_an_address_the_resolver_refuses_is_a_one_line_host_error(tmp_path):
    """A name whose label is longer than DNS allows (the resolver's IDNA codec raises UnicodeError):
    status says so in one line naming the host, exit 3, no traceback."""
    job = '\n[job]\ncommand = "true"\n'
    config = local_toml(tmp_path, '[run]\nname = "a"\noutput = "out"\n' + job)
    text = open(config).read().replace('name = "local"\naddress = "local"',
                                        f'name = "far"\naddress = "{"x" * 70}.example"')
    open(config, "w").write(text)
    r = fleet("status", "-c", config, timeout=120)
    assert r.returncode == 3 and "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.stderr == "fleet: no supervisor runs for run a here: read from the hosts once\n", r.stderr
    line = next(line for line in r.stdout.splitlines() if line.startswith("host far: unreachable"))
    assert line.endswith(f"the address '{'x' * 70}.example' is not a host name the resolver takes "
                         f"(label empty or too long))"), r.stdout


def test_an_unreadable_record_tail_and_progress_past_its_total_are_told(tmp_path):
    """A finished [job] shard whose events.jsonl then gets 3 MiB of bytes that are no record, and
    one whose progress line counts past its total: status --json and status name both, the
    record's good lines counted independently."""
    script = tmp_path / "job.py"
    script.write_text("import sys\nprint(f'processed {20 + 38 * int(sys.argv[1])}/20', flush=True)\n")
    job = (f'\n[job]\ncommand = "{sys.executable} {script} {{shard}}"'
           '\nprogress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"\n')
    config = local_toml(tmp_path, '[run]\nname = "d"\noutput = "out"\n' + job)
    text = open(config).read().replace("gpus = [0]", "gpus = [0, 1]")
    open(config, "w").write(text)
    assert fleet("up", "--headless", "-c", config).returncode == 0
    record = tmp_path / "fleet" / "d" / "shards" / "0" / "events.jsonl"
    good = sum(1 for line in open(record) if line.strip())
    with open(record, "ab") as f:
        f.write(b"\x00\xff" * (3 << 19))
    snap = json.loads(fleet("status", "--json", "-c", config).stdout)
    shards = {s["id"]: s for s in snap["shards"]}
    assert shards[0]["record_problem"] == f"events.jsonl: 3.1 MB unreadable after line {good:,}", shards[0]
    assert shards[0]["state"] == "DONE" and not shards[0]["over_total"]
    assert shards[1]["over_total"] and (shards[1]["done"], shards[1]["total"]) == (58, 20), shards[1]
    r = fleet("status", "-c", config)
    assert f"events.jsonl: 3.1 MB unreadable after line {good:,}" in r.stdout, r.stdout
    assert "58/20⚠" in r.stdout and "progress 58 is more than its total 20" in r.stdout, r.stdout
