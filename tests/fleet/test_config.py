"""fleet.toml validation: every bad input gets one line naming file:line and the key, exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleet.config import ConfigError, load_config, parse_duration
from fleet.jobs import Placement, shard_command
from worker import protocol

GOOD = """\
[run]
name = "qwen-hs"
model = "/models/m"
data = "/data/d.jsonl"
output = "/workspace/hs"
layers = "speculators"

[expected]
samples_per_s_per_gpu = 3.5

[supervise]
stall_timeout = "120s"
max_restarts = 3

[[hosts]]
name = "box1"
address = "203.0.113.7"
port = 22280
user = "root"
gpus = [0, 1]
root = "/workspace/fleet"

[[hosts]]
name = "box2"
address = "203.0.113.8"
"""


def write(tmp_path, text: str) -> str:
    p = tmp_path / "fleet.toml"
    p.write_text(text)
    return str(p)


def error_of(tmp_path, text: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text))
    return str(e.value)


def test_good_config_loads_with_defaults(tmp_path):
    c = load_config(write(tmp_path, GOOD))
    assert c.run.name == "qwen-hs" and c.spec.supervise.stall_timeout == 120.0
    # port, user, known_hosts left out: ~/.ssh/config's entry for the address, else ssh's defaults
    assert c.hosts[0].port == 22280 and c.hosts[1].port is None and c.hosts[1].gpus == "all"
    assert c.hosts[1].known_hosts is None and c.hosts[1].accept_new is False
    assert c.run_dir(c.hosts[0]) == "/workspace/fleet/qwen-hs"


@pytest.mark.parametrize("old, new, line, expected", [
    ('port = 22280', 'prot = 22280', 18, "unknown key 'prot' in [[hosts]] #1; did you mean 'port'?"),
    ('port = 22280', 'port = "x"', 18, "[[hosts]] #1 port: Input should be a valid integer"),
    ('port = 22280', 'port = 70000', 18, "port: Input should be less than or equal to 65535"),
    ('gpus = [0, 1]', 'gpus = [0, 0]', 20, "distinct GPU indices"),
    ('gpus = [0, 1]', 'gpus = "some"', 20, "gpus"),
    ('name = "box2"', 'name = "box1"', None, "duplicate host name 'box1'"),
    ('max_restarts = 3', 'max_restarts = -1', 13, "greater than or equal to 0"),
    ('stall_timeout = "120s"', 'stall_timeout = "soon"', 12, "not a duration"),
    ('user = "root"', 'password = "hunter2"', 19, "passwords are not accepted"),
    ('address = "203.0.113.8"', 'address = "-oProxyCommand=x"', 25, "must not be empty, start with '-'"),
    ('name = "qwen-hs"', 'name = "../escape"', 2, "letters, digits"),
    ('layers = "speculators"', 'layers = "fancy"', 6, "layers"),
    ('samples_per_s_per_gpu = 3.5', 'samples_per_s_per_gpu = 0', 9, "greater than 0"),
    ('[supervise]', '[superviseX]', 11, "unknown key 'superviseX' in the top level; did you mean 'supervise'?"),
    ('address = "203.0.113.8"', 'address = "box\u202e.example"', 25, "holds a control or bidirectional character"),
    ('output = "/workspace/hs"', 'output = []', 5, "run.output: a folder, or a list of folders (one per disk)"),
    ('output = "/workspace/hs"', 'output = ["/a", "/a"]', 5, "run.output: a folder listed twice"),
    ('output = "/workspace/hs"', 'output = ["/a", 3]', 5, "output"),
    ('output = "/workspace/hs"', 'output = "/workspace/hs"\ndestination = "s3://bucket/../x"', 6,
     "run.destination: a '.' or '..' in the path is taken literally by the store"),
])
def test_bad_values_name_file_line_and_key(tmp_path, old, new, line, expected):
    assert old in GOOD
    msg = error_of(tmp_path, GOOD.replace(old, new, 1))
    assert expected in msg, msg
    prefix = f"{tmp_path / 'fleet.toml'}:{line}:" if line else f"{tmp_path / 'fleet.toml'}"
    assert msg.startswith(prefix), msg
    assert "\n" not in msg


def test_malformed_toml_and_missing_file(tmp_path):
    msg = error_of(tmp_path, GOOD.replace("[run]", "[run", 1))
    assert msg.startswith(f"{tmp_path / 'fleet.toml'}:1: invalid TOML")
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "absent.toml"))
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe[run]")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(str(tmp_path / "bin.toml"))


def test_missing_required_keys(tmp_path):
    msg = error_of(tmp_path, GOOD.replace('output = "/workspace/hs"\n', ""))
    assert "run.output: required key missing" in msg
    msg = error_of(tmp_path, GOOD.split("[[hosts]]")[0])
    assert "hosts: required key missing" in msg


def test_custom_job_template_is_checked(tmp_path):
    job = GOOD + '\n[job]\ncommand = "{python} x.py --shard {shard} --rm {rm}"\n'
    assert "unknown placeholder {rm}" in error_of(tmp_path, job)
    job = GOOD + '\n[job]\ncommand = "{python} x.py"\ndone = "(unclosed"\n'
    assert "bad regex" in error_of(tmp_path, job)
    ok = GOOD + '\n[job]\ncommand = "{python} x.py --shard {shard} --num-shards {num_shards}"\ndone = "^DONE"\n'
    assert load_config(write(tmp_path, ok)).spec.job.done == "^DONE"


def test_a_job_taking_its_rows_is_checked_and_filled_in_by_its_runner(tmp_path):
    cmd = '\n[job]\ncommand = "{python} x.py --from {start} --to {end} --out {output}/{shard}"\n'
    err = error_of(tmp_path, GOOD + cmd)
    assert "command takes {start}/{end}: give rows" in err and "fleet.toml:" in err, err
    assert "rows is for a command taking {start}/{end}" in \
        error_of(tmp_path, GOOD + '\n[job]\ncommand = "{python} x.py {shard}"\nrows = 10\n')
    assert "leave out progress_glob and total" in \
        error_of(tmp_path, GOOD + cmd + 'rows = 10\nprogress_glob = "/x/{shard}*"\n')
    assert "greater than 0" in error_of(tmp_path, GOOD + cmd + 'rows = 10\nmin_chunk = 0\n')
    assert "more than rows = 10" in error_of(tmp_path, GOOD + cmd + 'rows = 10\nmin_chunk = 11\n')
    assert "valid integer" in error_of(tmp_path, GOOD + cmd + 'rows = true\n')
    assert "min_chunk is for a command taking" in \
        error_of(tmp_path, GOOD + '\n[job]\ncommand = "{python} x.py {shard}"\nmin_chunk = 5\n')
    for one, other in (("start", "end"), ("end", "start")):       # one alone: a run cannot know its rows
        err = error_of(tmp_path, GOOD + f'\n[job]\ncommand = "{{python}} x.py {{{one}}}"\nrows = 10\n')
        assert f"command takes {{{one}}} but not {{{other}}}" in err, err
    config = load_config(write(tmp_path, GOOD + cmd + "rows = 1000\n"))
    host = config.hosts[0]
    cmd = shard_command(config, host, Placement(1, host.name, 1), 4, pool=[0, 1])
    assert cmd.argv[-5:-2] == ["{start}", "--to", "{end}"]              # the runner fills them in
    assert cmd.rows == protocol.RowShare(num_rows=1000, num_shards=4, pool=[0, 1],
                                                                      min_chunk=2)   # 1% of a shard's rows


def test_durations():
    assert parse_duration("120s") == 120 and parse_duration("2m") == 120 and parse_duration(5) == 5
    assert parse_duration("1h") == 3600 and parse_duration("250ms") == 0.25
    with pytest.raises(ValueError):
        parse_duration("two minutes")


def test_cli_reports_config_errors_with_exit_2(tmp_path):
    path = write(tmp_path, GOOD.replace("port = 22280", "prot = 22280"))
    for cmd in (["status", "--json"], ["up", "--headless"], ["verify"], ["down", "--yes"]):
        r = subprocess.run([sys.executable, "-m", "fleet.cli", *cmd, "-c", path], capture_output=True, text=True)
        assert r.returncode == 2, (cmd, r.stderr)
        assert r.stderr.strip() == f"error: {path}:18: unknown key 'prot' in [[hosts]] #1; did you mean 'port'?"


# --- format, layers, loss mask --------------------------------------------------------------------

def test_format_layers_and_loss_mask_defaults_and_choices(tmp_path):
    run = load_config(write(tmp_path, GOOD.replace('layers = "speculators"\n', ""))).run
    assert (run.format, run.layers, run.loss_mask, run.target_last_hidden_states) == \
        ("speculators", None, "assistant", False)
    text = GOOD.replace('layers = "speculators"', 'format = "specforge-dflash"\nlayers = "from:/d/config.json"\n'
                                                  'loss_mask = "assistant-content"\ntarget_last_hidden_states = true')
    run = load_config(write(tmp_path, text)).run
    assert (run.format, run.layers_arg, run.loss_mask) == ("specforge-dflash", "from:/d/config.json", "assistant-content")
    for layers in ('"specforge-dflash:5"', '"eagle3"', '"speculators-dflash"', "[2, 17, 32]"):
        assert load_config(write(tmp_path, GOOD.replace('"speculators"', layers))).run.layers is not None


@pytest.mark.parametrize("new, expected", [
    ('layers = "dflash"', "run.layers: 'dflash' is ambiguous: speculators' DFlash and SpecForge's DFlash "
                          "read different layers; use one of speculators, speculators-eagle3"),
    ('layers = "specforge-dflash:x"', "expected specforge-dflash:<draft layers>"),
    ('layers = "from:"', "name the draft model's config.json"),
    ('format = "eagle2"', "run.format: Input should be 'speculators', 'specforge-eagle3', 'specforge-dflash' or 'eagle'"),
    ('loss_mask = "assistants"', "run.loss_mask: Input should be 'assistant', 'assistant-content' or 'all'"),
])
def test_format_layer_and_mask_errors_are_one_line(tmp_path, new, expected):
    msg = error_of(tmp_path, GOOD.replace('layers = "speculators"', new))
    assert msg.startswith(f"{tmp_path / 'fleet.toml'}:6: ") and expected in msg and "\n" not in msg, msg


def test_shard_command_carries_format_layers_and_mask(tmp_path):
    from fleet.jobs import Placement, shard_command
    text = GOOD.replace('layers = "speculators"', 'format = "specforge-dflash"\nlayers = "specforge-dflash:5"\n'
                                                  'target_last_hidden_states = true\nloss_mask = "all"')
    c = load_config(write(tmp_path, text))
    argv = shard_command(c, c.hosts[0], Placement(0, "box1", 0), 2).argv
    assert argv[argv.index("--format") + 1] == "specforge-dflash"
    assert argv[argv.index("--layers") + 1] == "specforge-dflash:5"
    assert argv[argv.index("--loss-mask") + 1] == "all" and "--target-last-hidden-states" in argv
    c = load_config(write(tmp_path, GOOD.replace('layers = "speculators"', 'format = "eagle"')))
    argv = shard_command(c, c.hosts[0], Placement(0, "box1", 0), 2).argv
    assert "--layers" not in argv and argv[argv.index("--format") + 1] == "eagle"   # the worker picks "eagle"


def test_python_dash_m_fleet_is_the_fleet_command():
    """`python -m fleet` for hosts where the `fleet` script is not on PATH: the same commands."""
    from tests.conftest import REPO
    r = subprocess.run([sys.executable, "-m", "fleet", "--help"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert all(cmd in r.stdout for cmd in ("up", "status", "down", "restart", "logs", "verify"))


def test_an_output_on_several_disks_spreads_the_samples_and_keeps_one_output_folder(tmp_path):
    """[run] output as a list: the first is the output folder (the [job]'s {output}, verify's, the
    plan's), the others go to the worker and its preflight as --spill, each folder with {host}."""
    c = load_config(write(tmp_path, GOOD.replace('output = "/workspace/hs"',
                                                 'output = ["/nvme0/{host}/hs", "/nvme1/{host}/hs"]')))
    assert c.output_dirs(c.hosts[0]) == ["/nvme0/box1/hs", "/nvme1/box1/hs"]
    assert c.output_dir(c.hosts[1]) == "/nvme0/box2/hs"
    argv = shard_command(c, c.hosts[0], Placement(0, "box1", 0), 3).argv
    assert argv[argv.index("--out") + 1:argv.index("--out") + 4] == ["/nvme0/box1/hs", "--spill", "/nvme1/box1/hs"]
