#!/usr/bin/env bash
# Record the demo for the ETA tests (tests/data/runs/demo-timed-*.jsonl, issue 25): the README's demo
# (`fleet up --headless` on the top-level fleet.toml, in a scratch copy) three times — on the machine
# as it is, beside one and beside three runs of the fast test lane (another session's load) — and
# copy each shard's events.jsonl out with the scratch paths made neutral.
#
#   bash bench/record_eta_runs.sh [OUT_DIR]          # ~6 minutes on 2 cores; OUT_DIR: tests/data/runs
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$repo/tests/data/runs}
for spec in a:0 b:1 c:3; do
    name=${spec%%:*} loads=${spec##*:}
    work=$(mktemp -d /tmp/eta-rec.XXXX)
    cp "$repo/fleet.toml" "$work/"
    for _ in $(seq 1 "$loads"); do
        (cd "$repo" && timeout 600 python -m pytest -m "not slow" -q -p no:cacheprovider tests/fleet tests/worker \
            >/dev/null 2>&1 &)
    done
    [ "$loads" -gt 0 ] && sleep 30
    echo "run $name beside $loads test lane(s): load $(cut -d' ' -f1 /proc/loadavg)"
    (cd "$work" && fleet up --headless | tail -n 1)
    echo "  load after: $(cut -d' ' -f1 /proc/loadavg)"
    pkill -f "pytest -m not slow" || true
    for k in 0 1; do
        sed "s#$work/#/tmp/rec/#g" "$work/.fleet-demo/fleet/demo/shards/$k/events.jsonl" > "$out/demo-timed-$name-$k.jsonl"
    done
    rm -rf "$work"
    sleep 5
done
python "$repo/bench/eta_replay.py" --every 10 "$out"/demo-timed-*.jsonl
