"""The worker's event log (worker/events.py): every event goes to events.jsonl, and the log says
what changed — a progress heartbeat with the counters of the last progress line is not printed
again (issue 55: each progress line appeared 2-6 times in a log, 43,200 lines a day per shard)."""

from __future__ import annotations

from worker import protocol
from worker.events import EventLog


def test_heartbeats_reach_the_record_but_the_log_prints_only_moved_counters(tmp_path, capsys):
    log = EventLog(str(tmp_path), 3)
    sent = [protocol.Progress(done=0, total=10), protocol.Progress(done=0, total=10),
            protocol.Progress(done=4, total=10, tokens=40), protocol.Progress(done=4, total=10, tokens=40),
            protocol.Progress(done=4, total=10, tokens=40), protocol.WarningEvent(message="slow disk"),
            protocol.Progress(done=4, total=10, tokens=40), protocol.Progress(done=4, total=12, tokens=40),
            protocol.Done(done=12, total=12, tokens=120)]
    for event in sent:
        log.emit(event)
    recorded = protocol.read_events(str(tmp_path / protocol.EVENTS_FILE))
    assert [type(e) for e in recorded] == [type(e) for e in sent]          # nothing lost to the record
    printed = [line for line in capsys.readouterr().out.splitlines() if line]
    assert [line.split()[2] for line in printed] == ["progress", "progress", "warning", "progress", "done"]
    assert "done=4 skipped=0 total=12" in printed[3]                         # a new total is news
