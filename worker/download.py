"""A run's destination copied to a local folder, ready for its trainer (issue 34).

A trainer reads a local folder. The destination holds every host's files, the manifests and one
meta.json, but speculators' `prepared/` index (an Arrow table and a link per row) cannot live in an
object store, so it is written here over every row once the files are down. The copy is rclone's
(resumable: what is already here with the same checksum is skipped; 16 files at once), showing
its progress every 10 s. The training command for the folder comes last.

    fleet download DIR                        # [run] destination of fleet.toml, its [run] env
    python -m worker.download URL DIR         # anywhere the worker's packages are
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Callable

from . import protocol
from .ship import ShipError, destination, rclone_error, rclone_streaming

PROGRESS = ("--transfers", "16", "--checkers", "16", "--stats", "10s", "--stats-one-line",
            "--stats-log-level", "NOTICE")


def download(url: str, folder: str, say: Callable[[str], None] = print) -> str:
    """Copy the destination `url` into `folder` and make it what its trainer reads; the training
    command for `folder`. ShipError (one line) when the destination cannot be read or holds no run."""
    dest = destination(url)
    os.makedirs(folder, exist_ok=True)
    say(f"downloading {url} to {folder} (rclone; what is here already is skipped)")
    copy = rclone_streaming(dest, "copy", dest.remote, folder, *PROGRESS)
    said: list[str] = []
    for line in copy.stderr:                     # its stats every 10 s, and its errors
        said = (said + [line.rstrip()])[-50:]
        if "Transferred:" in line:
            say("  " + line.strip().split("NOTICE: ")[-1].lstrip(": "))
    if copy.wait() != 0:
        raise ShipError(f"destination {url}: {rclone_error(chr(10).join(said)) or 'rclone failed'}")
    meta_path = os.path.join(folder, protocol.META_FILE)
    if not os.path.exists(meta_path):
        raise ShipError(f"destination {url}: no {protocol.META_FILE} there: nothing has been shipped yet")
    meta = json.load(open(meta_path))
    if meta.get("format", "speculators") == "speculators":
        from .prepared import write_prepared
        say(f"prepared/: {write_prepared(folder):,} rows indexed for speculators")
    from .trainers import training_command
    return training_command(meta, os.path.abspath(folder))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m worker.download", description=__doc__.splitlines()[0])
    ap.add_argument("url", help="the run's destination: s3://bucket/prefix, sftp://host/path or a path")
    ap.add_argument("folder", help="the local folder to fill (made if missing; a second run resumes)")
    args = ap.parse_args(argv)
    try:
        command = download(args.url, args.folder, lambda line: print(line, file=sys.stderr))
    except (ShipError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"train: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
