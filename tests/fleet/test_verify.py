"""fleet.verify's merge of the hosts' reports."""

from __future__ import annotations

import asyncio

import pytest

from fleet.deploy import run_worker_module
from fleet.transport import Completed, HostUnusable, Transport
from tests.faults.test_hostile_inputs import local_toml
from worker.protocol import VerifyReport


def test_verify_merge_refuses_hosts_in_different_formats():
    from fleet.verify import merge_reports
    a = {"num_samples": 4, "format": "speculators", "written": [[0, 2]], "skipped": {}, "problems": []}
    b = {"num_samples": 4, "format": "eagle", "written": [[2, 3]], "skipped": {}, "problems": []}
    result = merge_reports({"box1": VerifyReport.from_dict(a), "box2": VerifyReport.from_dict(b)})
    assert result.problems == ["box2: files in format eagle, another host's in speculators"]
    assert result.missing == [[3, 4]] and not result.ok


class Replies(Transport):
    """A transport whose every command prints `stdout` (what a host replied) and succeeds."""

    def __init__(self, stdout: str):
        super().__init__(None)
        self.stdout = stdout

    async def run(self, argv, timeout=None, input=None) -> Completed:
        return Completed(0, self.stdout, "")


@pytest.mark.parametrize("stdout,says", [
    ('progress\n{"num_samples": 4, "written": [[0, 4]], "problems": []}\n', None),
    ('{"num_samples": "four"}', ": VerifyReport.num_samples: int expected, not 'four'"),
    ('{"written": [[0, 2], 7]}', ": VerifyReport.written[1]: a list expected, not 7"),
    ('{"repaired": {"dropped": "all"}}', ": VerifyReport.repaired.dropped: a list expected, not 'all'"),
    ('[1, 2]', ": VerifyReport: an object expected, not [1, 2]"),
    ('Traceback (most recent call last):', " printed no result: Traceback (most recent call last):"),
])
def test_a_reply_is_parsed_once_where_it_arrives_and_a_malformed_one_names_the_host(tmp_path, stdout, says):
    from fleet.config import load_config
    config = load_config(local_toml(tmp_path, '[run]\nname = "r"\nmodel = "m"\ndata = "d.jsonl"\noutput = "o"\n'))
    go = run_worker_module(Replies(stdout), config, config.hosts[0], "verify", reply=VerifyReport)
    if says is None:
        report = asyncio.run(go)
        assert isinstance(report, VerifyReport) and report.written == [[0, 4]] and report.repaired is None
        return
    with pytest.raises(HostUnusable) as e:
        asyncio.run(go)
    assert str(e.value) == f"local: worker.verify{says}" and "\n" not in str(e.value)
