"""What moving a lost host's rows costs the supervisor, on a 64 x 8 fleet (issue 33).

The real Store (a fleet.toml of 64 hosts of 8 GPUs, every shard's record folded from a `started`
and a `progress` event as a worker writes them), one host unreachable for longer than
`host_lost_after`: the decide pass's relocation work (`Store.host_facts` + `relocate.orders`), the
receivers' `relocated` records folded in, then the snapshot with the moved shards shown holding
none. Prints the CPU time of each, per pass, and the rows moved.

    python bench/relocate.py [--hosts 64] [--gpus 8] [--rows 900000] [--passes 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fleet import relocate                      # noqa: E402
from fleet.config import load_config             # noqa: E402
from fleet.judge import policy_for               # noqa: E402
from fleet.engine import make_launcher          # noqa: E402
from fleet.plan import make_plan                 # noqa: E402
from fleet.store import Store                    # noqa: E402
from fleet.transport import HostError            # noqa: E402
from worker import protocol                      # noqa: E402
from worker.ranges import shard_range            # noqa: E402


def fleet_toml(folder: str, hosts: int, gpus: int) -> str:
    text = '[run]\nname = "bench"\nmodel = "m"\ndata = "d"\noutput = "out"\n\n[supervise]\nhost_lost_after = "10m"\n'
    text += "".join(f'\n[[hosts]]\nname = "h{i}"\naddress = "10.0.{i // 250}.{i % 250}"\n'
                    f'gpus = {list(range(gpus))}\n' for i in range(hosts))
    path = os.path.join(folder, "fleet.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--rows", type=int, default=900_000)
    ap.add_argument("--passes", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        config = load_config(fleet_toml(d, args.hosts, args.gpus))
    engine = make_launcher(config)
    store = Store(config, policy_for(config), engine)
    store.use_plan(make_plan(config, engine.place({h.name: list(range(args.gpus)) for h in config.hosts}), engine.kind, {}))
    n, now = store.num_shards, time.time()
    for host in store.hosts:                     # each agent's stream opens with its hello
        store.apply(host, protocol.Hello(protocol=protocol.PROTOCOL_VERSION), now=now)
    for s in store.shards.values():
        a, b = shard_range(args.rows, n, s.id)
        host = s.placement.host
        for ev in (protocol.Launch(launch=1, by="manual", gpu=s.placement.gpu, t=now - 600),
                   protocol.Started(launch=1, shard=s.id, num_shards=n, start=a, stop=b, total=b - a,
                                    num_rows=args.rows, t=now - 590),
                   protocol.Progress(launch=1, done=(b - a) // 3, skipped=0, total=b - a, t=now - 5)):
            store.apply(host, protocol.EventMessage(shard=s.id, event=ev.to_dict()), now=now)
    for h in store.hosts.values():
        h.up()
        h.replay_done()
    lost = store.hosts["h7"]
    lost.down(HostError("h7: connection refused"), now=now - 700)
    after = config.spec.supervise.host_lost_after

    verdicts = {s.id: store.verdict(s, now) for s in store.shards.values()}
    t0 = time.process_time()
    for _ in range(args.passes):
        due = relocate.orders(store.host_facts(verdicts, now, after), store.moves)
    decide_ms = (time.process_time() - t0) / args.passes * 1e3
    for order in due:                                # what the receivers' records then say
        for a, b in order.runs:
            store.moves.seen(protocol.Relocated(start=a, stop=b, from_host=order.from_host, to_host=order.to_host,
                                                side="in", redone=order.redone, t=now))
    t0 = time.process_time()
    for _ in range(args.passes):
        again = relocate.orders(store.host_facts(verdicts, now, after), store.moves)
    settled_ms = (time.process_time() - t0) / args.passes * 1e3
    t0 = time.process_time()
    snaps = max(args.passes // 20, 1)
    for _ in range(snaps):
        snap = store.snapshot(now)
    snapshot_ms = (time.process_time() - t0) / snaps * 1e3
    moved = [s for s in snap.shards if s.host == "h7"]
    assert again == [] and all(not s.holds_rows for s in moved), "the move was not taken as done"
    print(f"{args.hosts} hosts x {args.gpus} GPUs, {args.rows:,} rows, host h7 lost: "
          f"{len(due)} adopt orders, {snap.totals.rows_relocated:,} rows relocated "
          f"({snap.totals.rows_redone:,} redone); decide pass with the move due {decide_ms:.2f} ms CPU, "
          f"after it {settled_ms:.2f} ms, snapshot {snapshot_ms:.1f} ms")


if __name__ == "__main__":
    main()
