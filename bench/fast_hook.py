"""The worker's path choice with the fast kernels in it, for a GPU run of this checkout (issue 56).

worker/warmup.py (not this change's file) chooses the path; the change it needs is two lines in
`choose_path`, before `compile_layers(model)` of the dense/MoE path:

    from .kernels import use_fast_kernels
    fast = use_fast_kernels(model, device)           # "" when the model has nothing they serve

and the note in the path it returns: `f"compiled (...){'; ' + fast if fast else ''}"`. Until it
lands, `python3 bench/fast_hook.py` makes that edit in the copy a GPU run works on (idempotent;
it refuses when choose_path no longer reads as expected, and changes nothing then).
"""

from __future__ import annotations

import os
import sys

TARGET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "worker", "warmup.py")
ANCHOR = "    compile_layers(model)\n"
HOOK = ("    from .kernels import use_fast_kernels\n"
        "    fast = use_fast_kernels(model, device)            # issue 56: the [fast] kernels, where they run\n")
RETURN = '    return f"compiled ({seconds:.0f} s to compile{f\', cache {cache}\' if cache else \'\'})"\n'
RETURN_FAST = ('    return (f"compiled ({seconds:.0f} s to compile{f\', cache {cache}\' if cache else \'\'})"\n'
               '            + (f"; {fast}" if fast else ""))\n')


def patched(source: str) -> str | None:
    """`source` with the hook in, or None when it is not the choose_path this expects."""
    if HOOK in source:
        return source
    if source.count(ANCHOR) != 1 or source.count(RETURN) != 1:
        return None
    return source.replace(ANCHOR, HOOK + ANCHOR).replace(RETURN, RETURN_FAST)


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else TARGET
    with open(path) as f:
        source = f.read()
    new = patched(source)
    if new is None:
        print(f"fast_hook: {path}: choose_path is not as expected; left alone", file=sys.stderr)
        return 1
    if new != source:
        with open(path, "w") as f:
            f.write(new)
    print(f"fast_hook: {path}: hooked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
