"""A [job] whose command takes its rows ({start}/{end}) shares its host's rows like the built-in
worker (worker/ranged.py, issue 33): the real supervisor, agent and runner on this machine, over
three local "GPUs", running tests/jobs/rows_job.py, which writes each row it finishes (with its
shard and time) to one file — what the tests read back: every row exactly once, by whom, when."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

from fleet.render import finished_summary, format_status
from fleet.snapshot import status_exit_code
from fleet.state import State
from fleet.tui.panes.shards import detail
from tests.conftest import wait_for
from tests.fleet.conftest import LOST_AFTER, fleet, hosts_toml, lose_host, two_hosts, up_headless
from tests.sshd_server import serve
from worker import protocol

from .test_records import shard, started, until

ROWS_JOB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "rows_job.py")
MARK = re.compile(r"launch \d+: rows ([\d,]+)–([\d,]+)")


def rows_toml(tmp_path, rows: int, job_args: str, gpus=(0, 1, 2), min_chunk: int = 2, stall: str = "60s") -> str:
    out = tmp_path / "out"
    (tmp_path / "fleet.toml").write_text(f"""
[run]
name = "rows"
output = "{out}"

[supervise]
max_restarts = 1
backoff_base = "0.3s"
stop_grace = "1s"
stall_timeout = "{stall}"

[job]
command = "{sys.executable} {ROWS_JOB} {out} {{start}} {{end}} {{shard}} {job_args}"
done = "ALL DONE"
fail = "ERROR"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"
rows = {rows}
min_chunk = {min_chunk}

[[hosts]]
name = "local"
address = "local"
gpus = {json.dumps(list(gpus))}
root = "{tmp_path / 'fleet'}"
""")
    return str(tmp_path / "fleet.toml")


def written(tmp_path) -> list[tuple[int, int, float]]:
    """(row, shard, time) of every row the job finished, in the order written."""
    path = tmp_path / "out" / "rows.txt"
    if not path.exists():
        return []
    return [(int(i), int(s), float(t)) for i, s, t in (line.split() for line in path.read_text().splitlines())]


def chunks(tmp_path, k: int) -> list[tuple[int, int]]:
    """The rows of each run of the command on shard k, from the runner's marks in its log."""
    log = (tmp_path / "fleet" / "rows" / "shards" / str(k) / "log").read_text()
    return [(int(a.replace(",", "")), int(b.replace(",", ""))) for a, b in MARK.findall(log)]


def events(tmp_path, k: int) -> list:
    path = tmp_path / "fleet" / "rows" / "shards" / str(k) / protocol.EVENTS_FILE
    return [protocol.parse_event(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


async def test_a_slow_slot_and_a_dead_one_finish_together_with_every_row_once(tmp_path):
    """Slot 1 three times slower than slot 0, slot 2's command always failing: the run finishes with
    every row written once, slot 2 FATAL holding none (its rows done by the others), the slow slot
    doing fewer rows than the fast one, and the two ending within one run of the command of each
    other (the longest time between two chunks ending on one slot, in the same run)."""
    logs: list[str] = []
    sup = await started(rows_toml(tmp_path, 480, "--sleep 0.02 --slow 1=3 --crash 2"), logs)
    try:
        await until(lambda: sup.snapshot().totals.finished, timeout=240, what="the run finished")
        snap = sup.snapshot()
        assert [snap.shards[k].state for k in range(3)] == [State.DONE, State.DONE, State.FATAL]
        assert not snap.shards[2].holds_rows and snap.shards[2].lease.startswith("none: rows")
        assert snap.totals.rows_moved >= 160
        moves = [line for line in logs if line.startswith("rows 320–480 of local:2 (")]   # the log view's line
        assert moves and re.match(r"rows 320–480 of local:2 \((FATAL|BACKOFF|FAILED|PENDING|STARTING)\) → local:[01] "
                                  r"\(160 to do\)$", moves[0]), logs
        # a [job] counts samples: no token or byte figure anywhere, null in the JSON (issue 39)
        assert snap.totals.tokens is None and snap.totals.avg_tokens_per_s is None
        assert snap.totals.bytes_written is None and snap.totals.usd_per_million_tokens is None
        assert all(s.tokens is None and s.bytes is None and s.tokens_per_s is None for s in snap.shards)
        summary = finished_summary(snap)
        assert "2/3 shards DONE" in summary and " B" not in summary and "tok" not in summary, summary
        assert "tok" not in detail(snap.shards[0]).plain and "tok" not in format_status(snap)
        assert "verify" not in format_status(snap) and not snap.verifiable     # a [job]'s output is its own
        assert sup.refusal(0, "restart") == "shard 0 is DONE: nothing to redo"
        assert status_exit_code(snap) == 0                 # finished: the FATAL slot's rows were done
        assert snap.totals.eta_left_out == []             # ...so the ETA leaves nothing out
    finally:
        await sup.close()
    rows = written(tmp_path)
    assert sorted(i for i, _, _ in rows) == list(range(480))           # each row exactly once
    by = {k: [t for _, s, t in rows if s == k] for k in range(3)}
    assert not by[2] and 0 < len(by[1]) < len(by[0])
    ends = {k: max(by[k]) for k in (0, 1)}
    longest = 0.0                           # one "lease's time": the longest wait between chunk ends
    for k in (0, 1):
        row_t = {i: t for i, s, t in rows if s == k}
        marks = [row_t[b - 1] for a, b in chunks(tmp_path, k) if b - 1 in row_t]
        start = min(t for _, s, t in rows)
        longest = max([longest] + [b - a for a, b in zip([start] + marks, marks)])
    assert abs(ends[0] - ends[1]) <= longest, (ends, longest)
    assert {b - a for k in (0, 1) for a, b in chunks(tmp_path, k)} != {160}       # leased, not fixed


async def test_restart_of_a_fatal_slot_relaunches_it_into_the_pool(tmp_path):
    """`r` (the user's restart) on a FATAL slot whose lease another slot took over: it comes back
    with no lease of its own, steals half of a live holder's unread rows and finishes them; every
    row once, every slot DONE. Rows from 160 on wait behind a gate for slots 0 and 1, so rows are
    still unread when the restart comes, whatever the machine's pace."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "gate").touch()
    sup = await started(rows_toml(tmp_path, 480, "--sleep 0.005 --crash 2 --gate-from 160 --ungated 2"))
    try:
        await until(lambda: shard(sup, 2).state == State.FATAL, timeout=120, what="slot 2 FATAL")
        await until(lambda: any(isinstance(e, protocol.LeaseMoved) and e.why == "dead" for e in events(tmp_path, 2)),
                    timeout=120, what="slot 2's lease taken over")
        (tmp_path / "out" / "heal-2").touch()
        result = await sup.request([2], "restart")
        assert result[2].status in ("started", "restarting"), result
        await until(lambda: [i for i, s, _ in written(tmp_path) if s == 2], timeout=120, what="slot 2 writing rows")
        running = format_status(sup.snapshot()).splitlines()[0]          # mid-run: samples only
        assert "samples/s" in running and "tokens" not in running and "written" not in running, running
        (tmp_path / "out" / "gate").unlink()
        await until(lambda: sup.snapshot().totals.finished, timeout=240, what="the run finished")
        snap = sup.snapshot()
        assert [snap.shards[k].state for k in range(3)] == [State.DONE] * 3
    finally:
        await sup.close()
    rows = written(tmp_path)
    assert sorted(i for i, _, _ in rows) == list(range(480))
    leases = [e for e in events(tmp_path, 2) if isinstance(e, protocol.Leased)]
    assert leases[-1].how == "stolen" and leases[-1].start >= 160
    log = (tmp_path / "fleet" / "rows" / "shards" / "2" / "log").read_text()     # and its log says so
    assert f"leased rows {leases[-1].start:,}–{leases[-1].stop:,} (stolen from shard {leases[-1].from_shard})" in log
    assert {i for i, s, _ in rows if s == 2} <= {i for e in leases for i in range(e.start, e.stop)}


async def test_a_killed_runner_whose_chunk_runs_on_keeps_its_rows_until_every_process_of_it_is_gone(tmp_path):
    """Slot 0's runner SIGKILLed while its command runs a chunk (issue 53): the chunk runs on,
    holding the slot's alive lock it inherited, so slot 1, out of rows, takes none of slot 0's
    until that process has ended — rows may be done again after it, never by two at once — and
    the run finishes with every row."""
    sup = await started(rows_toml(tmp_path, 24, "--sleep 0.05 --slow 0=20", gpus=(0, 1), min_chunk=4))
    try:
        folder = tmp_path / "fleet" / "rows" / "shards" / "0"
        await until(lambda: any(s == 0 for _, s, _ in written(tmp_path)), 120, what="slot 0's first row")
        chunk = int((folder / "pid").read_text())
        os.kill(int((folder / "runner.pid").read_text()), signal.SIGKILL)
        await until(lambda: not os.path.exists(f"/proc/{chunk}") or
                    open(f"/proc/{chunk}/stat").read().split(")")[1].split()[0] == "Z", 60,
                    what="the orphaned chunk to end")
        ended = time.time()
        await until(lambda: sup.snapshot().totals.finished, 180, what="the run finished")
    finally:
        await sup.stop_all()
        await sup.close()
    rows = written(tmp_path)
    assert [1 for _, s, t in rows if s == 0 and t <= ended] and sorted({i for i, _, _ in rows}) == list(range(24))
    for i in {i for i, _, _ in rows}:                        # a row written twice: the second after the orphan
        times = sorted(t for j, _, t in rows if j == i)
        assert len(times) == 1 or times[1] > ended - 0.05, (i, times, ended, rows)


def test_a_lost_hosts_rows_are_finished_by_the_other_host_and_it_stops_them_once_back(tmp_path):
    """Two hosts over two real sshds, each with two slots of the job: host b's box is gone (its
    processes killed, its sshd cut) for longer than host_lost_after: its rows are adopted by a,
    whose slots finish them (every row on a, once) and the run ends; b back: it is told first,
    its shards stop holding rows, and nothing more is written on b."""
    out = {name: tmp_path / "remote" / f"out-{name}" for name in ("a", "b")}
    job = f"""[job]
command = "{{python}} {ROWS_JOB} {{output}} {{start}} {{end}} {{shard}} --sleep 0.1"
done = "ALL DONE"
progress = "processed (?P<done>\\\\d+)/(?P<total>\\\\d+)"
rows = 400
min_chunk = 4
"""
    with two_hosts(tmp_path) as (servers, procs):
        config = hosts_toml(tmp_path, servers, model=None, data=None, gpus={"a": [0, 1], "b": [0, 1]},
                            output=str(tmp_path / "remote" / "out-{host}"), job=job, supervise=LOST_AFTER)
        up, lines = up_headless(config)
        try:
            wait_for(lambda: (out["b"] / "rows.txt").exists() and
                     len((out["b"] / "rows.txt").read_text().splitlines()) > 10, 120, what="host b writing")
            # The supervisor has heard b's shards running (its agent stream up: under load it starts
            # after the rows do), and a few telemetry ticks of their progress, before b is gone.
            wait_for(lambda: all(any(re.search(rf"shard {k} b:\d+ \S+ -> RUNNING", line) for line in lines)
                                 for k in (2, 3)), 120, what="b's shards heard RUNNING")
            time.sleep(1.0)
            lose_host(tmp_path, procs, "b", (2, 3))
            on_b = len((out["b"] / "rows.txt").read_text().splitlines())
            assert up.wait(300) == 0, "\n".join(lines)
        finally:
            if up.poll() is None:
                up.kill()
        text = "\n".join(lines)
        assert "rows 200–400 of b (lost) → a (200 rows)" in text, text
        rows_a = [int(line.split()[0]) for line in (out["a"] / "rows.txt").read_text().splitlines()]
        assert sorted(rows_a) == list(range(400)), text          # every row on a, once
        r = fleet("status", "--json", "-c", config)
        snap = json.loads(r.stdout)
        assert snap["totals"]["finished"] is True and snap["totals"]["rows_relocated"] == 200, r.stdout
        assert 0 < snap["totals"]["rows_redone"] <= on_b

        procs["b"] = serve(servers["b"])              # b is back
        r = fleet("up", "--headless", "-c", config, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "b: back; its rows 200–400 went to a" in r.stderr + r.stdout
        snap = json.loads(fleet("status", "--json", "-c", config).stdout)
        assert [s["state"] for s in snap["shards"]] == ["DONE"] * 4 and snap["totals"]["finished"]
        assert not any(s["holds_rows"] for s in snap["shards"][2:])
        assert len((out["b"] / "rows.txt").read_text().splitlines()) == on_b    # nothing redone on b


async def test_a_slot_waiting_for_a_peers_last_chunk_is_not_stalled(tmp_path):
    """Two slots, each lease one chunk (min_chunk = its rows): slot 0 is done in a moment, slot 1's
    chunk takes ~8 s, longer than a stall_timeout of 4 s; slot 0, with nothing to steal, waits for
    it saying it is alive (a progress tick every 2 s) — never STALLED, never restarted — and both
    end DONE with every row once."""
    logs: list[str] = []
    sup = await started(rows_toml(tmp_path, 16, "--sleep 0.01 --slow 1=100", gpus=(0, 1), min_chunk=8,
                                  stall="4s"), logs)
    try:
        await until(lambda: sup.snapshot().totals.finished, timeout=120, what="the run finished")
        assert [s.state for s in sup.snapshot().shards] == [State.DONE, State.DONE]
    finally:
        await sup.close()
    assert not [line for line in logs if "STALLED" in line], logs
    assert [e.launch for e in events(tmp_path, 0) if isinstance(e, protocol.Launch)] == [1]
    ends = {k: max(t for _, s, t in written(tmp_path) if s == k) for k in (0, 1)}
    assert ends[1] - ends[0] > 4.0                      # slot 0 did wait longer than the stall timeout
    assert sorted(i for i, _, _ in written(tmp_path)) == list(range(16))


def test_the_preflight_table_wraps_its_verdict_by_words_at_the_terminals_width(tmp_path):
    """Issue 39: at 80 columns the terminal cut the table's verdict mid-word ("GPU index 0 out o /
    f range"). `fleet up` in an 80-column terminal (COLUMNS, as a shell sets it) prints every line of
    the table within 80 columns, the verdict's words whole under its own column."""
    config = rows_toml(tmp_path, 6, "", gpus=(0, 1, 2))
    r = fleet("up", "--headless", "-c", config, env={**os.environ, "COLUMNS": "80"}, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("host ") and "result" in line)
    table = [lines[top]] + [line for line in lines[top + 1:top + 8] if line.startswith(("local ", " " * 20))]
    assert len(table) > 2 and all(len(line) <= 80 for line in table), table
    column = lines[top].index("result")
    verdict = " ".join(line[column:].strip() for line in table[1:])
    assert "warning: GPU index 0 out of range" in verdict, table        # words whole, in order
    assert all(line[:column].strip() == "" for line in table[2:]), table
