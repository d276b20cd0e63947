"""The test hosts' Python: this interpreter, but `worker` and `fleet` import only from the folders
on PYTHONPATH (where fleet deploys its worker), never from this checkout's install — as on a GPU
host where fleet is not installed. A command that runs `worker.*` where fleet has not put it then
fails in the tests as it would there, instead of quietly running the checkout's copy.

Run as the interpreter would be: `host_python.py -m module args`, `-c code args` or `script args`
(`host_python()` in tests/conftest.py writes the executable that does so)."""

from __future__ import annotations

import os
import runpy
import sys
from importlib.machinery import PathFinder

HIDDEN = ("worker", "fleet")


class OnlyDeployed:
    """A meta path finder in front of every other: the hidden packages from PYTHONPATH or not at all."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name not in HIDDEN:
            return None
        folders = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        spec = PathFinder.find_spec(name, folders)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return spec


def main() -> None:
    sys.meta_path.insert(0, OnlyDeployed)
    args = sys.argv[1:]
    if args[:1] == ["-m"]:
        sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    elif args[:1] == ["-c"]:
        sys.argv, sys.path[0] = ["-c", *args[2:]], ""
        exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv, sys.path[0] = args, os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
