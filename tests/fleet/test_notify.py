"""[notify]: the real supervisor, following a real local [job] run (runner, agent, scripted jobs),
runs a real command on the transitions chosen, with the event as JSON on its stdin; the command
records what it was given."""

from __future__ import annotations

import json
import os
import sys

import pytest

from fleet.config import load_config
from fleet.state import State
from fleet.supervisor import Supervisor
from tests.fleet.test_records import job_toml, shard, started, until

RECORDER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "record_notice.py")


def with_notify(path: str, out, on: list[str], extra: str = "") -> str:
    with open(path, "a") as f:
        f.write(f"""
[notify]
command = '{sys.executable} {RECORDER} {out} "two words" $HOME'
on = {json.dumps(on)}
{extra}
""")
    return path


def told(out) -> list[dict]:
    return [json.loads(l) for l in open(out)] if os.path.exists(out) else []


async def test_notify_runs_the_command_on_chosen_transitions_with_the_event_on_stdin(tmp_path):
    out = tmp_path / "notices.jsonl"
    script = {
        "0": [[["progress", 1, 2], ["sleep", 0.5], ["print", "ERROR: disk quota exceeded"], ["exit", 1]],
              [["progress", 1, 2], ["sleep", 0.5], ["progress", 2, 2], ["print", "extract-only mode"], ["exit", 0]]],
        "1": [[["progress", 1, 2], ["sleep", 1.5], ["progress", 2, 2], ["print", "extract-only mode"], ["exit", 0]]],
    }
    config = with_notify(job_toml(tmp_path, script, backoff="0.3s"), out, ["FAILED", "FATAL", "DONE", "finished"])
    sup = await started(config)
    try:
        await until(lambda: sup.snapshot().totals.finished, timeout=60, what="both DONE")
    finally:
        await sup.close()                           # tells what just changed, waits for the commands
    records = told(out)
    events = [(r["notice"]["event"], (r["notice"]["shard"] or {}).get("id")) for r in records]
    # One process per notice, running side by side: the file's order is theirs, not the events'.
    assert sorted(events, key=str) == [("DONE", 0), ("DONE", 1), ("FAILED", 0), ("finished", None)]
    # Split like a [job] command, never by a shell: one argument with a space, $HOME untouched.
    assert all(r["argv"] == [str(out), "two words", "$HOME"] for r in records)
    failed = next(r["notice"] for r in records if r["notice"]["event"] == "FAILED")
    assert failed["schema"] == "fleet.notify/1" and failed["run"] == "job"
    assert failed["shard"]["last_failure"] == "fail sentinel: ERROR: disk quota exceeded"
    assert "ERROR: disk quota exceeded" in failed["message"]
    assert failed["previous"] in ("PENDING", "STARTING", "RUNNING")   # as last seen, 0.25 s apart
    finished = next(r["notice"] for r in records if r["notice"]["event"] == "finished")
    assert finished["totals"]["finished"] and "2/2 shards DONE" in finished["message"]


async def test_a_failing_notify_command_is_logged_and_supervision_goes_on(tmp_path, monkeypatch):
    out = tmp_path / "notices.jsonl"
    monkeypatch.setenv("FLEET_TEST_NOTIFY_EXIT", "3")
    script = {"0": [[["progress", 1, 1], ["sleep", 1.5], ["print", "extract-only mode"], ["exit", 0]]]}
    config = with_notify(job_toml(tmp_path, script, gpus=(0,)), out, ["DONE"], 'timeout = "10s"')
    logs: list[str] = []
    sup = await started(config, logs)
    try:
        await until(lambda: shard(sup, 0).state == State.DONE, what="DONE")
        await until(lambda: any(m.startswith("notify:") for m in logs), what="the failure logged")
    finally:
        await sup.close()
    assert told(out)[0]["notice"]["event"] == "DONE"
    assert [m for m in logs if m.startswith("notify:")] == \
        [f"notify: {sys.executable} exited 3: notify test: failing on purpose"]
    assert load_config(config).spec.notify.argv[1:] == [RECORDER, str(out), "two words", "$HOME"]
    assert Supervisor(load_config(config)).notifier is not None


@pytest.mark.parametrize("section, expected", [
    ('[notify]\ncommand = "true fleet"\non = ["FAILED", "broken"]\n', ":29: notify.on.1: Input should be"),
    ('[notify]\ncommand = "notify-send \'fleet"\n', ":28: notify.command: cannot split command"),
    ('[notify]\ncommand = "  "\n', ":28: notify.command: empty command"),
    ('[notify]\ncommand = "true"\nalert_after = "later"\n', ":29: notify.alert_after: not a duration"),
    ('[notify]\ncommand = "true"\nwhen = ["DONE"]\n', ":29: unknown key 'when' in [notify]"),
    ('[notify]\ncommand = "/nonexistent/notify-me --x"\n',
     ":28: notify.command: /nonexistent/notify-me: not found here, or not executable"),
])
def test_notify_and_price_errors_name_file_and_line(tmp_path, section, expected):
    from tests.fleet.test_config import GOOD, error_of
    msg = error_of(tmp_path, GOOD + "\n" + section)
    assert msg.startswith(str(tmp_path / "fleet.toml")) and expected in msg, msg
    msg = error_of(tmp_path, GOOD.replace('root = "/workspace/fleet"', 'usd_per_hour = -2'))
    assert ":21: [[hosts]] #1 usd_per_hour: Input should be greater than or equal to 0" in msg


def test_notify_and_price_defaults(tmp_path):
    from tests.fleet.test_config import GOOD, write
    c = load_config(write(tmp_path, GOOD.replace('root = "/workspace/fleet"', "usd_per_hour = 21.5")
                          + '\n[notify]\ncommand = "echo publish fleet"\n'))
    assert c.hosts[0].usd_per_hour == 21.5 and c.hosts[1].usd_per_hour is None
    n = c.spec.notify
    assert (n.argv, n.on, n.alert_after, n.timeout) == (["echo", "publish", "fleet"],
                                                         ["FAILED", "FATAL", "alert", "finished"], 120.0, 30.0)
    assert load_config(write(tmp_path, GOOD)).spec.notify is None
