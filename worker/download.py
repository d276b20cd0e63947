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
from .files import WORK_DIR, write_atomic
from .ship import ShipError, destination, rclone_error, rclone_streaming

PROGRESS = ("--transfers", "16", "--checkers", "16", "--stats", "10s", "--stats-one-line",
            "--stats-log-level", "NOTICE")


def download(url: str, folder: str, say: Callable[[str], None] = print) -> str:
    """Copy the destination `url` into `folder` and make it what its trainer reads; the training
    command for `folder`. ShipError (one line) when the destination cannot be read or holds no run."""
    dest = destination(url)
    claim_folder(folder, url)
    say(f"downloading {url} to {folder} (rclone; what is here already is skipped)")
    copy = rclone_streaming(dest, "copy", dest.remote, folder, *PROGRESS)
    said: list[str] = []
    assert copy.stderr is not None, "rclone_streaming pipes its stderr"
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


MARK = os.path.join(WORK_DIR, "download.json")     # which destination a folder is the download of


def claim_folder(folder: str, url: str) -> None:
    """`folder` made the download of `url`: an empty (or new) folder, or one this destination was
    downloaded to before (the copy resumes). A folder holding anything else — another run's
    download, files of its own — is refused, one line naming what is there: nothing is merged."""
    if os.path.isdir(folder) and (there := sorted(os.listdir(folder))):
        try:
            with open(os.path.join(folder, MARK)) as f:
                mark = json.load(f)
        except (OSError, ValueError):
            mark = None
        if not isinstance(mark, dict):
            shown = ", ".join(there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
            raise ShipError(f"{folder} is not empty ({shown}) and is no download of fleet's: download into an "
                            f"empty folder (nothing here is merged or overwritten)")
        if mark.get("url") != url:
            raise ShipError(f"{folder} holds the download of {mark.get('url')!r}: download {url} into another "
                            f"folder (two runs' files in one folder would train as one)")
    os.makedirs(os.path.join(folder, WORK_DIR), exist_ok=True)
    write_atomic(os.path.join(folder, MARK), json.dumps({"url": url}))


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
