"""A run's plan and its output have one identity (through a real sshd, real workers, real files):
another model or dataset into the same output is refused, the shard layout is fixed at the first
launch and followed by every command, `verify --repair` makes broken output redoable, and
fleet.toml changes are refused until `fleet up --replan`."""

from __future__ import annotations

import glob
import json
import os

import pytest

from tests.conftest import run_worker
from tests.fleet.conftest import stop_supervisor, fleet, fleet_popen, hosts_toml
from tests.sshd_server import start_sshd

pytestmark = pytest.mark.ssh


def launches(tmp_path, host: str, run: str, shard: int) -> list[dict]:
    path = tmp_path / f"root-{host}" / run / "shards" / str(shard) / "events.jsonl"
    return [e for e in map(json.loads, open(path)) if e["event"] == "launch"]


def argv_value(launch: dict, flag: str) -> str:
    return launch["argv"][launch["argv"].index(flag) + 1]


@pytest.fixture
def data(tmp_path):
    from worker.demo import make_token_dataset
    return lambda n, name="d", seed=11: make_token_dataset(str(tmp_path / f"{name}.jsonl"), n, vocab_size=500,
                                                           mean_tokens=30, seed=seed)


@pytest.fixture
def box2(tmp_path):
    server, proc = start_sshd(str(tmp_path / "sshd2"))
    yield server, proc
    if proc.poll() is None:
        proc.terminate()
        proc.wait(10)


def test_another_model_or_dataset_into_the_same_output_is_refused(tmp_path, sshd, dense_model, data):
    from worker.demo import make_model
    d1 = data(40)
    config = hosts_toml(tmp_path, {"box": sshd}, model=dense_model, data=d1, gpus={"box": [0]})
    assert fleet("up", "--headless", "-c", config).returncode == 0
    first = open(config).read()
    meta = open(tmp_path / "out" / "meta.json").read()
    # Same shape, other weights; same row count, other rows; another run name, the same output.
    other_model = make_model(str(tmp_path / "other-model"), seed=1)
    d2 = data(40, name="d2", seed=12)
    other = hosts_toml(tmp_path, {"box": sshd}, model=other_model, data=d2, gpus={"box": [0]}, run="t2")
    r = fleet("up", "--headless", "-c", other)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "holds another run's work (its meta.json)" in r.stderr
    assert "model.weights:" in r.stderr and "data.first_row:" in r.stderr and "Traceback" not in r.stderr
    assert open(tmp_path / "out" / "meta.json").read() == meta            # nothing touched
    # The worker on its own refuses too, before touching a file, and says retrying cannot help.
    state = str(tmp_path / "state")
    w = run_worker("--model", other_model, "--data", d2, "--out", str(tmp_path / "out"), "--state", state)
    assert w.returncode == 1 and "holds another run's work" in w.stderr
    failed = [json.loads(l) for l in open(os.path.join(state, "events.jsonl")) if '"failed"' in l]
    assert failed[-1]["fatal"] is True
    assert open(tmp_path / "out" / "meta.json").read() == meta
    v = fleet("verify", "-c", other)                 # (the second run's fleet.toml: the output is not its)
    assert v.returncode == 1 and "box: belongs to run 't' (its .fleet/owner.json), not to run 't2'" in v.stdout
    open(config, "w").write(first)                   # (hosts_toml wrote both at one path)
    v = fleet("verify", "-c", config)
    assert v.returncode == 0, v.stdout + v.stderr


def test_the_layout_is_fixed_at_the_first_launch_and_followed_by_every_command(
        tmp_path, sshd, box2, dense_model, data):
    server2, proc2 = box2
    rows = data(3000)
    servers = {"box1": sshd, "box2": server2}
    config = hosts_toml(tmp_path, servers, model=dense_model, data=rows, gpus={"box1": [0], "box2": [0]})
    up = fleet_popen("up", "--headless", "-c", config)
    try:
        import time
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not os.path.exists(tmp_path / "root-box2" / "t" / "shards" / "1" / "pid"):
            time.sleep(0.2)
        up.kill()
        up.wait(10)
        stop_supervisor(config)                                        # every command on its own from here
        assert json.load(open(tmp_path / "root-box1" / "t" / "plan.json"))["num_shards"] == 2
        assert json.load(open(tmp_path / "root-box2" / "t" / "plan.json")) == \
            json.load(open(tmp_path / "root-box1" / "t" / "plan.json"))
        # box2 goes away; shard 0 restarted from box1 keeps the plan's layout (2 shards).
        proc2.terminate()
        proc2.wait(10)
        rs = fleet("restart", "0", "-c", config)
        assert rs.returncode == 0, rs.stdout + rs.stderr
        assert argv_value(launches(tmp_path, "box1", "t", 0)[-1], "--num-shards") == "2"
        st = json.loads(fleet("status", "--json", "-c", config).stdout)
        assert [(s["id"], s["host"]) for s in st["shards"]] == [(0, "box1"), (1, "box2")]
        assert st["shards"][1]["state"] == "UNKNOWN"                  # listed from the plan, not lost
        # Growing box1's GPUs while shards are live: refused, with the differences and the way out.
        grown = hosts_toml(tmp_path, {"box1": sshd}, model=dense_model, data=rows, gpus={"box1": [0, 1]})
        r = fleet("up", "--headless", "-c", grown)
        assert r.returncode == 1 and "gpus of box1: [0] -> [0, 1]. To run the new plan" in r.stderr, r.stderr
        assert "`fleet down`, then `fleet up --replan`" in r.stderr
        assert argv_value(launches(tmp_path, "box1", "t", 0)[-1], "--num-shards") == "2"   # nothing launched
        r = fleet("status", "--json", "-c", grown)                     # box2 taken out: its shards UNKNOWN
        st = json.loads(r.stdout)
        assert r.returncode == 3 and [s["state"] for s in st["shards"]][1] == "UNKNOWN", r.stdout + r.stderr
        assert "no longer in fleet.toml" in st["shards"][1]["reason"]
    finally:
        if up.poll() is None:
            up.kill()
        fleet("down", "--yes", "-c", config)
    # box2 back; everything stopped. A changed layout is refused until --replan, which covers
    # every row exactly once with the finished samples kept.
    server2b, proc2b = start_sshd(str(tmp_path / "sshd2b"))
    try:
        servers = {"box1": sshd, "box2": server2b}
        old_plan = json.load(open(tmp_path / "root-box1" / "t" / "plan.json"))
        grown = hosts_toml(tmp_path, servers, model=dense_model, data=rows, gpus={"box1": [0, 1], "box2": [0]})
        r = fleet("up", "--headless", "-c", grown)
        assert r.returncode == 1
        assert "gpus of box1: [0] -> [0, 1]" in r.stderr and "fleet up --replan" in r.stderr
        before = {int(json.loads(l)["index"]) for p in glob.glob(str(tmp_path / "out" / "manifest" / "*"))
                  for l in open(p)}
        r = fleet("up", "--headless", "--replan", "-c", grown)
        assert r.returncode == 0, r.stdout + r.stderr
        plan = json.load(open(tmp_path / "root-box2" / "t" / "plan.json"))
        assert plan["num_shards"] == 3 and plan["created"] > old_plan["created"]
        assert os.path.isdir(tmp_path / "root-box1" / "t" / f"shards.before-{int(plan['created'])}")
        v = fleet("verify", "-c", grown)
        assert v.returncode == 0 and "3000 written" in v.stdout, v.stdout
        indices = [int(json.loads(l)["index"]) for p in glob.glob(str(tmp_path / "out" / "manifest" / "*"))
                   for l in open(p)]
        assert sorted(indices) == list(range(3000)) and before <= set(indices)
    finally:
        proc2b.terminate()
        proc2b.wait(10)


def test_verify_repair_drops_broken_output_and_up_redoes_exactly_it(tmp_path, sshd, dense_model, data):
    config = hosts_toml(tmp_path, {"box": sshd}, model=dense_model, data=data(60), gpus={"box": [0, 1]})
    assert fleet("up", "--headless", "-c", config).returncode == 0
    out = tmp_path / "out"
    with open(out / "hs_7.safetensors", "r+b") as f:
        f.truncate(100)
    os.unlink(out / "hs_45.safetensors")
    v = fleet("verify", "-c", config)
    assert v.returncode == 1 and "sample 7:" in v.stdout and "sample 45:" in v.stdout
    assert fleet("up", "--headless", "-c", config).returncode == 0        # DONE: nothing redone yet
    assert fleet("verify", "-c", config).returncode == 1
    r = fleet("verify", "--repair", "-c", config)
    assert "dropped 2 broken or missing sample(s) [7, 45]" in r.stdout, r.stdout
    assert "shard 0: 1 sample(s) to redo" in r.stdout and "shard 1: 1 sample(s) to redo" in r.stdout
    assert not os.path.exists(out / "hs_7.safetensors")
    st = json.loads(fleet("status", "--json", "-c", config).stdout)
    assert [s["state"] for s in st["shards"]] == ["PENDING", "PENDING"]
    assert fleet("up", "--headless", "-c", config).returncode == 0
    v = fleet("verify", "-c", config)
    assert v.returncode == 0 and "60 written" in v.stdout, v.stdout
    assert [len(launches(tmp_path, "box", "t", k)) for k in (0, 1)] == [2, 2]


def test_repair_reopens_the_lines_a_done_shards_manifest_lost(tmp_path, sshd, dense_model, data):
    config = hosts_toml(tmp_path, {"box": sshd}, model=dense_model, data=data(30), gpus={"box": [0]})
    assert fleet("up", "--headless", "-c", config).returncode == 0
    manifest = tmp_path / "out" / "manifest" / "0.jsonl"
    lines = manifest.read_text().splitlines(keepends=True)
    manifest.write_text("".join(lines[:-3]))                       # lost the last 3 lines
    v = fleet("verify", "-c", config)
    assert v.returncode == 1 and "missing: 3 sample(s)" in v.stdout, v.stdout
    r = fleet("verify", "--repair", "-c", config)
    assert "shard 0: 3 sample(s) to redo" in r.stdout, r.stdout
    assert fleet("up", "--headless", "-c", config).returncode == 0
    v = fleet("verify", "-c", config)
    assert v.returncode == 0 and "30 written" in v.stdout, v.stdout


def test_a_manifest_line_outside_the_dataset_is_named_and_repair_refuses_it_changing_nothing(
        tmp_path, sshd, dense_model, data):
    """A manifest holding index -1 (no run of this data wrote it): verify names it, --repair refuses
    in one line and leaves every manifest as it was; a lost meta.json is told as what it is."""
    config = hosts_toml(tmp_path, {"box": sshd}, model=dense_model, data=data(30), gpus={"box": [0, 1]})
    assert fleet("up", "--headless", "-c", config).returncode == 0
    manifests = tmp_path / "out" / "manifest"
    clean = (manifests / "1.jsonl").read_text()
    with open(manifests / "1.jsonl", "a") as f:
        f.write(json.dumps({"index": -1, "tokens": 3, "bytes": 10}) + "\n")
    before = {p.name: p.read_text() for p in manifests.iterdir()}
    v = fleet("verify", "-c", config)
    assert v.returncode == 1 and "sample -1: in manifest/1.jsonl, outside the dataset's 30 rows" in v.stdout, v.stdout
    r = fleet("verify", "--repair", "-c", config)
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "--repair refused: manifest/1.jsonl holds index -1, outside the dataset" in r.stdout, r.stdout
    assert {p.name: p.read_text() for p in manifests.iterdir()} == before          # nothing moved
    (manifests / "1.jsonl").write_text(clean)
    os.unlink(tmp_path / "out" / "meta.json")
    v = fleet("verify", "-c", config)
    assert v.returncode == 1 and "no meta.json on any host, though 30 sample file(s)" in v.stdout, v.stdout


def test_host_names_swapped_in_fleet_toml_are_refused_before_any_launch(tmp_path, sshd, dense_model, data):
    """Each host's root holds its identity file (written at first deploy) and the plan records it
    per host name: two names swapped after `fleet down` point at the other machines (here: the
    other roots) and `up` refuses, saying so, instead of re-extracting each other's rows."""
    config = hosts_toml(tmp_path, {"box1": sshd, "box2": sshd}, model=dense_model, data=data(40),
                        gpus={"box1": [0], "box2": [0]})
    assert fleet("up", "--headless", "-c", config).returncode == 0
    ids = {h: (tmp_path / f"root-{h}" / "host-id").read_text().strip() for h in ("box1", "box2")}
    assert ids["box1"] != ids["box2"]
    plan = json.load(open(tmp_path / "root-box1" / "t" / "plan.json"))
    assert plan["host_ids"] == ids
    text = open(config).read()
    swapped = text.replace("root-box1", "root-X").replace("root-box2", "root-box1").replace("root-X", "root-box2")
    open(config, "w").write(swapped)
    r = fleet("up", "--headless", "-c", config)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"host box1 is another machine: the plan's box1 is {ids['box1']}, fleet.toml's box1 is {ids['box2']}" \
        in r.stderr, r.stderr
    assert [len(launches(tmp_path, h, "t", k)) for h, k in (("box1", 0), ("box2", 1))] == [1, 1]
    # `fleet restart` takes no preflight: the host's agent says which machine it is.
    rs = fleet("restart", "0", "-c", config)
    assert rs.returncode == 3 and "Traceback" not in rs.stderr, rs.stdout + rs.stderr
    assert f"box1 is another machine: the plan's box1 is {ids['box1']}, this one is {ids['box2']}" in rs.stderr
    assert [len(launches(tmp_path, h, "t", k)) for h, k in (("box1", 0), ("box2", 1))] == [1, 1]


def test_another_run_into_the_same_output_is_refused_by_preflight(tmp_path, sshd, dense_model, data):
    d = data(20)
    config = hosts_toml(tmp_path, {"box": sshd}, model=dense_model, data=d, gpus={"box": [0]})
    assert fleet("up", "--headless", "-c", config).returncode == 0
    other = hosts_toml(tmp_path, {"box": sshd}, model=dense_model, data=d, gpus={"box": [0]}, run="t2")
    r = fleet("up", "--headless", "-c", other)
    assert r.returncode == 1 and "belongs to run 't'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_extra_args_are_part_of_the_plan(tmp_path):
    """A flag in extra_args changes what is written as much as the same key in [run] does."""
    from fleet.config import load_config
    import dataclasses

    from fleet.engine.hosts import HostLauncher
    from fleet.plan import make_plan, plan_differences

    def plan_with(extra: str):
        path = tmp_path / "fleet.toml"
        path.write_text(f"""
[run]
name = "x"
model = "m"
data = "d.jsonl"
output = "out"
device = "cpu"
extra_args = {extra}

[[hosts]]
name = "local"
address = "local"
gpus = [0]
root = "r"
""")
        config = load_config(str(path))
        return make_plan(config, HostLauncher(config).place({"local": [0]}), None, {})
    old = plan_with('["--max-length", "4096"]')
    assert plan_differences(old, plan_with('["--max-length", "4096"]')) == []
    assert plan_differences(old, plan_with('["--max-length", "64"]')) == \
        ['extra_args: ["--max-length", "4096"] -> ["--max-length", "64"]']
    before = dataclasses.replace(old, spec={k: v for k, v in old.spec.items() if k != "extra_args"})  # made before
    assert plan_differences(before, plan_with("[]")) == []


def test_nothing_counts_as_done_that_did_nothing(tmp_path, sshd, dense_model, data):
    def up_with(rows_text: str, name: str, **kw):
        path = tmp_path / name
        path.write_text(rows_text)
        cfg = hosts_toml(tmp_path, {"box": sshd}, model=dense_model, data=str(path), gpus={"box": [0]},
                         output=str(tmp_path / f"out-{name}"), **kw)
        return fleet("up", "--headless", "-c", cfg), cfg
    rows = [{"input_ids": [1, 2, 3, 4]} for _ in range(5)]
    r, _ = up_with(json.dumps(rows, indent=2), "array.json")
    assert r.returncode == 1 and "a JSON array, not JSON lines" in r.stderr
    r, _ = up_with("", "empty.jsonl")
    assert r.returncode == 1 and "empty (0 rows)" in r.stderr
    r, _ = up_with("\n".join(json.dumps({"text": "hi"}) for _ in range(5)) + "\n", "bad.jsonl")
    assert r.returncode == 1 and "none of the first 5 rows is usable" in r.stderr
    # Good first rows, then 30% rows the worker must skip: the shard fails at once, with counts
    # and reasons, and is not retried (a restart would skip the same rows).
    good = [json.dumps({"input_ids": [5, 6, 7] * 5}) for _ in range(70)]
    r, cfg = up_with("\n".join(good + ["[1, 2]"] * 30) + "\n", "skips.jsonl")
    assert r.returncode == 1, r.stdout
    assert "skipped 30 of 100 rows (30.0% > max_skip_fraction 0.01): row is not an object (30)" in r.stdout
    assert "not retried" in r.stdout and len(launches(tmp_path, "box", "t", 0)) == 1
    v = fleet("verify", "-c", cfg)
    assert "70 written, 30 skipped (30.00%)" in v.stdout
    assert v.returncode == 1 and "30 of 100 rows skipped (30.00% > max_skip_fraction 0.01)" in v.stdout


def test_one_bad_sample_never_kills_a_shard(tmp_path, dense_model):
    """A row longer than the model's positions is skipped before the forward; any other error a
    sample causes inside a batch is isolated by bisection and that sample alone skipped."""
    rows = [{"input_ids": [9] * 5000}] + [{"input_ids": [3, 4, 5] * 8} for _ in range(20)]
    rows[12] = {"input_ids": [3, 4, 77, 5] * 6}                              # token 77 fails
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    inject = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "faults", "inject")
    out, state = str(tmp_path / "out"), str(tmp_path / "state")
    r = run_worker("--model", dense_model, "--data", str(tmp_path / "d.jsonl"), "--out", out,
                   "--state", state, "--max-skip-fraction", "0.2",
                   env={**os.environ, "PYTHONPATH": inject, "FLEET_INJECT_ERROR_TOKEN": "77"})
    assert r.returncode == 0, r.stderr
    skipped = {e["index"]: e["reason"] for e in map(json.loads, open(os.path.join(state, "events.jsonl")))
               if e["event"] == "sample_skipped"}
    assert skipped == {0: "longer than the model's 4096 positions: 5000 tokens",
                       12: "RuntimeError in the forward pass: injected failure on token 77 (alone, after the rest)"}
    assert len(glob.glob(os.path.join(out, "hs_*.safetensors"))) == 19
