"""The 27B hybrid's projections one GEMM at a time, against the measured bf16 peak (issue 38).

A real pass spends 81.8% of the GPU's time in GEMMs at about 91% of the peak on average
(docs/benchmarks.md, round 13). This says which projections hold the rest, and what fusing the
small ones would give: each weight shape of a layer (x @ W.T, bf16, as nn.Linear runs it) at
M = 16,384 tokens and at 12,000 (a batch of long rows short of the budget), median over 5
sweeps of the median of 10, with
its calls per forward, and the same for candidate fusions (one GEMM for several projections).

    python3 bench/gemm_shapes.py --json gemm-shapes.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from bench.extract import interleaved_medians, median_seconds

H, I = 5120, 17408                       # the 27B hybrid (bench/gpu_fleet.HYBRID27)
GDN, ATTN = 48, 16                       # layers of each kind
# name: (out features, in features, calls per forward)
PROJECTIONS = {
    "gdn q": (2048, H, GDN), "gdn k": (2048, H, GDN), "gdn v": (6144, H, GDN), "gdn z": (6144, H, GDN),
    "gdn b": (48, H, GDN), "gdn a": (48, H, GDN), "gdn out": (H, 6144, GDN),
    "attn q+gate": (12288, H, ATTN), "attn k": (1024, H, ATTN), "attn v": (1024, H, ATTN), "attn o": (H, 6144, ATTN),
    "mlp gate": (I, H, GDN + ATTN), "mlp up": (I, H, GDN + ATTN), "mlp down": (H, I, GDN + ATTN),
}
FUSED = {           # one GEMM in place of several: (out features, in features, calls, replaces)
    "gdn b|a": (96, H, GDN, ("gdn b", "gdn a")),
    "gdn z|b|a": (6240, H, GDN, ("gdn z", "gdn b", "gdn a")),
    "gdn q|k": (4096, H, GDN, ("gdn q", "gdn k")),
    "attn k|v": (2048, H, ATTN, ("attn k", "attn v")),
    "mlp gate|up": (2 * I, H, GDN + ATTN, ("mlp gate", "mlp up")),
}


def gemm(m: int, out_f: int, in_f: int, reps: int) -> float:
    x = torch.randn(m, in_f, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(out_f, in_f, device="cuda", dtype=torch.bfloat16)
    return median_seconds(lambda: torch.nn.functional.linear(x, w), reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5, help="sweeps over all shapes; each shape's median over them")
    p.add_argument("--tokens", default="16384,12000")
    args = p.parse_args()
    peak = 2 * 8192 ** 3 / gemm(8192, 8192, 8192, 10)
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "peak_tflops": round(peak / 1e12, 1)}
    shapes = {**PROJECTIONS, **{k: v[:3] for k, v in FUSED.items()}}
    for m in (int(t) for t in args.tokens.split(",")):
        rows, total_s, total_flops = {}, 0.0, 0.0
        seconds = interleaved_medians({name: (lambda o=out_f, i=in_f: gemm(m, o, i, args.reps))
                                       for name, (out_f, in_f, _calls) in shapes.items()}, args.rounds)
        for name, (out_f, in_f, calls) in shapes.items():
            s = seconds[name]
            flops = 2 * m * out_f * in_f
            rows[name] = {"ms": round(s * 1e3, 4), "of_peak": round(flops / s / peak, 3), "calls": calls,
                          "ms_per_forward": round(s * 1e3 * calls, 2)}
            if name in PROJECTIONS:
                total_s += s * calls
                total_flops += flops * calls
        for name, (*_, parts) in FUSED.items():
            rows[name]["saves_ms_per_forward"] = round(sum(rows[q]["ms_per_forward"] for q in parts)
                                                       - rows[name]["ms_per_forward"], 2)
        result[str(m)] = {"projections": rows, "gemm_ms_per_forward": round(total_s * 1e3, 1),
                          "of_peak": round(total_flops / total_s / peak, 3)}
        print(json.dumps({m: result[str(m)]}), flush=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
