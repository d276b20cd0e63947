"""A shard's part in [run] destination: its Shipper, started with the files of its earlier launches
counted, and at its end the files its pool's dead mates left on the disk shipped in their name.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

from . import protocol
from .events import EventLog
from .files import manifest_entries, manifest_path
from .formats import Layout
from .ship import ShipError, Shipper, destination, owner_problem, ship_leftovers
from .shard_setup import read_plan_file


def start_shipping(args: argparse.Namespace, log: EventLog, layout: Layout) -> Shipper | None:
    """With --destination: the shard's Shipper, its files of earlier launches counted, running."""
    if not args.destination:
        return None
    dest = destination(args.destination)
    run = (read_plan_file(args.plan) if args.plan else {}).get("run")
    if run and (problem := owner_problem(dest, run)):   # (preflight refused it; another run since?)
        raise ShipError(problem)
    mine = os.path.basename(manifest_path(args.out, args.shard_index))
    records = [rec for name, rec in manifest_entries(args.out) if name == mine]

    def tell(event: protocol.Shipping) -> None:
        log.emit(event)

    return Shipper(args.out, dest, args.shard_index,
                   lambda i: layout.path(args.out, i), args.keep_local, tell, tuple(args.spill)).resume(records)


def ship_pool_leftovers(args: argparse.Namespace, layout: Layout, shipper: Shipper,
                        beat: Callable[[], None]) -> None:
    """At its end a shard ships what its pool's dead mates left on the disk (ship.ship_leftovers),
    each mate's figures told in that mate's own record."""
    shards = os.path.dirname(os.path.abspath(args.state)) if args.state else None

    def emit_for(k: int) -> Callable[[protocol.Shipping], None]:
        if not shards or os.path.basename(shards) != "shards":
            return lambda ev: None
        return lambda ev: protocol.append_jsonl(os.path.join(shards, str(k), protocol.EVENTS_FILE), ev)
    ship_leftovers(args.out, shipper.dest, set(args.pool) - {args.shard_index},
                   lambda i: layout.path(args.out, i), emit_for, beat, tuple(args.spill))
