"""bench/fp8.py cannot rot: its CPU smoke mode runs the whole script (outlier injection, the real
extraction path in bf16 and fp8, precision from the files, the sweep) on a tiny model, and its
figures must say what the GPU run will be read for. No time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_the_fp8_benchmark_runs_on_the_cpu_and_its_figures_hold(tmp_path):
    out = tmp_path / "fp8.json"
    r = subprocess.run([sys.executable, "bench/fp8.py", "--cpu-smoke", "--samples", "16", "--precision-samples", "16",
                        "--sweep", "1000,100000", "--disk", str(tmp_path), "--json", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert r.stdout.strip().splitlines()[-1].startswith("fp8 / bf16: ")         # the table comes last
    assert res["layer_ids"] == [2, 4, 5, 8] and res["last_layer_norm"] == "pre"
    assert 500 < res["outliers"]["achieved_ratio"] < 2000                        # what it injected, measured
    # Half the bytes: fp8 files are the fp8 values, a float32 scale per token per layer, ids and mask.
    assert res["payload_bytes_per_token"] == {"bf16": 4 * 64 * 2, "fp8": 4 * (64 + 4)}
    assert res["fp8"]["bytes_per_token"] < 0.6 * res["bf16"]["bytes_per_token"]
    assert res["fp8"]["host_buffer_bytes"] < 0.6 * res["bf16"]["host_buffer_bytes"]
    assert res["bf16"]["samples"] == res["fp8"]["samples"] == 16 and res["bf16"]["tokens"] == res["fp8"]["tokens"]
    # The files of the real path are exactly the quantisation of the bf16 states.
    p = res["precision"]
    assert p["samples"] == 16 and p["fp8_files_equal_quantised_bf16_files"] == 16
    for ours in p["per_token_per_layer"]:
        assert ours["rel_err"] < 0.04 and ours["min_cos"] > 0.995
    # As the outliers grow, per-layer scales keep the other layers; per-token scales lose them.
    low, high = res["sweep"]
    for row in (low, high):
        assert max(x["rel_err"] for x in row["per_token_per_layer"][:-1]) < 0.04
    assert max(x["rel_err"] for x in high["per_token_speculators"][:-1]) > 0.2
    assert all(x in r.stdout for x in ("per token per layer (ours)", "per token (speculators)", "bytes/token"))
