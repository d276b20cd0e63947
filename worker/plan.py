"""`<root>/<run>/plan.json`: the run's plan, fixed at its first launch and stored on every host.

It holds the shard layout (id, host, GPU; `num_shards`), the fleet.toml values the work depends
on, and the identity of the work (worker.identity). Every fleet command reads it back from any
reachable host instead of recomputing it. Standard library only.

    python -m worker.plan write --run-dir R [--archive-records]   (the plan as JSON on stdin)

A new plan for a run that already ran (`fleet up --replan`) moves the old shard records aside
(`shards` → `shards.before-<time>`): a record judged DONE under the old layout says nothing about
the new one. The output folder is untouched, so finished samples are kept by global index.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .files import replace_atomically
from .protocol import Plan

PLAN_FILE = "plan.json"
PLAN_VERSION = 1


def plan_path(run_dir: str) -> str:
    return os.path.join(run_dir, PLAN_FILE)


def read_plan(run_dir: str) -> Plan | None:
    """The plan, or None when there is none (or it is unreadable: then the caller replans)."""
    try:
        with open(plan_path(run_dir)) as f:
            d = json.load(f)
        plan = Plan.from_dict(d)
    except (OSError, ValueError):          # ReplyError is a ValueError
        return None
    return plan if plan.version == PLAN_VERSION else None


def write_plan(run_dir: str, plan: Plan, archive_records: bool = False) -> None:
    os.makedirs(run_dir, exist_ok=True)
    records = os.path.join(run_dir, "shards")
    if archive_records and os.path.isdir(records):
        os.rename(records, f"{records}.before-{int(plan.created)}")
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(plan.to_dict(), f, indent=1, sort_keys=True)
    replace_atomically(plan_path(run_dir), write)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.plan")
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("--run-dir", required=True)
    w.add_argument("--archive-records", action="store_true",
                   help="a new plan: move the old shard records aside")
    args = ap.parse_args(argv)
    os.umask(os.umask(0o022) | 0o022)
    plan = Plan.from_dict(json.loads(sys.stdin.read()))
    write_plan(args.run_dir, plan, args.archive_records)
    print(json.dumps({"status": "written", "path": plan_path(args.run_dir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
