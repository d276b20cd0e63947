"""The stdlib-only modules both sides import (worker/ranges.py, worker/text.py, worker/files.py,
worker/ship.py, and worker/leases.py, which ship reads):
each property compares the module with an independent statement of what it must do."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker import files, protocol, ranges, text

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_shared_modules_import_only_the_standard_library():
    """fleet installs without numpy or torch; a host may have only the stdlib beside them."""
    code = ("import sys; before = set(sys.modules); import worker.ranges, worker.text, worker.files, worker.ship; "
            "print('\\n'.join(sorted(set(sys.modules) - before)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": ROOT}).stdout.split()
    foreign = [m for m in out if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "worker"]
    ours = {m for m in out if m.split(".")[0] == "worker" and not m.startswith("worker.protocol.")}   # (its parts)
    assert foreign == []
    assert ours <= {"worker", "worker.protocol", "worker.ranges", "worker.text", "worker.files", "worker.ship",
                    "worker.leases"}   # (ship: which rows moved to another host)


@given(st.integers(0, 10**17))
def test_a_size_as_bytes_text_writes_it_parses_back_to_itself(n):
    """parse_bytes reads what bytes_text writes (decimal units), to bytes_text's own rounding."""
    shown = text.bytes_text(n, 3)
    assert abs(text.parse_bytes(shown.replace(" ", "")) - n) <= max(n, 1) * 0.0005 + 1


def test_sizes_in_binary_units_and_bad_ones():
    assert text.parse_bytes("500GiB") == 500 * 2**30 and text.parse_bytes("1.5 TB") == 1_500_000_000_000
    assert text.parse_bytes(7) == 7
    for bad in ("lots", "-5GB", "5 XB", ""):
        with pytest.raises(ValueError):
            text.parse_bytes(bad)


# --- ranges ------------------------------------------------------------------------------------

@given(st.integers(0, 10_000), st.integers(1, 200))
def test_shards_cover_every_row_exactly_once_in_order(num_rows, num_shards):
    bounds = [ranges.shard_range(num_rows, num_shards, k) for k in range(num_shards)]
    assert bounds[0][0] == 0 and bounds[-1][1] == num_rows
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))          # contiguous, disjoint
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0


@given(st.data())
def test_shard_of_is_the_inverse_of_shard_range(data):
    num_rows = data.draw(st.integers(1, 5_000))
    num_shards = data.draw(st.integers(1, 64))
    i = data.draw(st.integers(0, num_rows - 1))
    k = ranges.shard_of(i, num_rows, num_shards)
    a, b = ranges.shard_range(num_rows, num_shards, k)
    assert a <= i < b


@pytest.mark.parametrize("shards,k", [(0, 0), (3, 3), (3, -1)])
def test_a_shard_outside_the_run_is_refused(shards, k):
    with pytest.raises(ValueError):
        ranges.shard_range(10, shards, k)


def parse_ranges(s: str) -> list[int]:
    """An independent reader of "0-2,5,7-8" (as Slurm reads --array)."""
    out: list[int] = []
    for part in filter(None, re.split(r",\s*", s)):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        assert m, part
        a, b = int(m[1]), int(m[2] or m[1])
        assert a <= b
        out += range(a, b + 1)
    return out


@given(st.lists(st.integers(0, 300)), st.sampled_from([",", ", "]))
def test_ranges_text_round_trips_and_is_as_short_as_it_can_be(indices, sep):
    s = text.ranges_text(indices, sep)
    assert parse_ranges(s) == sorted(set(indices))
    parts = [p for p in s.split(sep) if p]
    assert len(parts) == len({i - rank for rank, i in enumerate(sorted(set(indices)))})  # one part a run


@given(st.lists(st.integers(-50, 300)))
def test_runs_expand_back_to_the_indices(indices):
    runs = ranges.to_runs(indices)
    assert list(ranges.expand(runs)) == sorted(set(indices))
    assert all(a < b for a, b in runs)


def test_ranges_text_examples():
    assert text.ranges_text([8, 0, 1, 2, 5, 7, 2]) == "0-2,5,7-8"
    assert text.runs_text([[3, 4], [6, 9]], ", ") == "3, 6-8"
    assert text.ranges_text([]) == ""


# --- text --------------------------------------------------------------------------------------

def test_last_line():
    assert text.last_line("a\n  b  \n\n\n") == "b"
    assert text.last_line("") == text.last_line(" \n ") == "(no output)"
    assert text.last_line("x" * 500) == "x" * 300
    assert text.last_line("downloading 10%\rdownloading 99%\r\n") == "downloading 99%"


def test_exit_words():
    assert text.exit_words(None) == "ended without an exit status"
    assert text.exit_words(-9) == "killed by signal 9"
    assert text.exit_words(0) == "exited with code 0"
    assert text.exit_words(3) == "exited with code 3"


@given(st.floats(0, 1e20, allow_nan=False))
def test_bytes_text_reads_back_within_its_rounding(n):
    s = text.bytes_text(n)
    value, unit = s.split()
    scale = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "PB": 1e15}[unit]
    assert abs(float(value) * scale - n) <= 0.05 * scale + 0.5
    assert unit == "PB" or float(value) < 1000.5


def test_bytes_text_examples():
    assert text.bytes_text(None) == "?"
    assert text.bytes_text(999) == "999 B"
    assert text.bytes_text(1234567) == "1.2 MB"
    assert text.bytes_text(12.41e12, 2) == "12.41 TB"


# --- files -------------------------------------------------------------------------------------

def test_write_atomic_replaces_whole_with_its_mode(tmp_path):
    path = str(tmp_path / "f")
    files.write_atomic(path, "one", 0o600)
    files.write_atomic(path, b"two\n", 0o600)
    assert open(path).read() == "two\n"
    assert os.stat(path).st_mode & 0o777 == 0o600 & ~_umask()
    assert os.listdir(tmp_path) == ["f"]


def test_a_failed_write_leaves_the_old_file_and_no_temp(tmp_path):
    path = str(tmp_path / "f")
    files.write_atomic(path, "old")

    def broken(tmp: str) -> None:
        open(tmp, "w").write("half")
        raise OSError("disk full")
    with pytest.raises(OSError):
        files.replace_atomically(path, broken)
    assert open(path).read() == "old" and os.listdir(tmp_path) == ["f"]


def test_the_temp_file_is_named_so_no_reader_lists_it(tmp_path):
    seen = []
    files.replace_atomically(str(tmp_path / "hs_3.safetensors"), lambda tmp: (seen.append(tmp), open(tmp, "w").close()))
    assert os.path.basename(seen[0]).startswith(protocol.TEMP_PREFIX)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@settings(max_examples=30)
@given(st.lists(st.lists(st.one_of(st.integers(0, 40), st.none(), st.text(max_size=3)), max_size=8),
                min_size=0, max_size=4))
def test_manifest_records_yields_every_indexed_line_in_file_order(tmp_path_factory, shards):
    out = tmp_path_factory.mktemp("out")
    expected = []
    for k, indices in enumerate(shards):
        os.makedirs(os.path.dirname(files.manifest_path(str(out), k)), exist_ok=True)
        with open(files.manifest_path(str(out), k), "w") as f:
            for i in indices:
                f.write(json.dumps({"index": i, "bytes": 1}) + "\n")
            f.write('{"index": 99, "torn')                              # a line cut by a kill
        expected += [i for i in indices if isinstance(i, int)]
    assert [r["index"] for r in files.manifest_records(str(out))] == expected      # (under 10 shards:
                                                                                     # name order is k's)


def test_no_manifest_folder_is_no_records(tmp_path):
    assert list(files.manifest_records(str(tmp_path))) == []
