"""fleet.verify's merge of the hosts' reports."""

from __future__ import annotations


def test_verify_merge_refuses_hosts_in_different_formats():
    from fleet.verify import merge_reports
    a = {"num_samples": 4, "format": "speculators", "written": [[0, 2]], "skipped": {}, "problems": []}
    b = {"num_samples": 4, "format": "eagle", "written": [[2, 3]], "skipped": {}, "problems": []}
    result = merge_reports({"box1": a, "box2": b})
    assert result.problems == ["box2: files in format eagle, another host's in speculators"]
    assert result.missing == [[3, 4]] and not result.ok
