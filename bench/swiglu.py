"""The SwiGLU MLP's gate, up and SiLU·mul as one Triton GEMM kernel, against the compiled MLP the
worker runs (issue 38, round 14). A probe: the kernel lost to cuBLAS, so the worker does not use it
(docs/benchmarks.md).

The model's MLP runs `down(silu(gate(x)) * up(x))`: two GEMMs write gate(x) and up(x) out, then an
elementwise kernel reads both back and writes their product (3.2% of the 27B hybrid's kernel time,
round 13). The kernel here computes, per output tile, both products over the same tile of x (two
fp32 accumulators; tiles read by the tensor-memory engine through Triton's TensorDescriptor, on a
persistent grid) and writes only silu(g) * u, with g and u rounded as a GEMM would write them.

For each shape (the 27B hybrid's MLP, the dense bench shape's) and token count it times: the
unfused gate/up product as the worker's compiled MLP runs it (two cuBLAS GEMMs and Inductor's
fused SiLU·mul), the two GEMMs alone (what any fusion must match), gate|up as one cuBLAS GEMM
over concatenated weights, the fused kernel at each tile configuration, and the whole MLP (with
down) unfused and fused; each the median over `--rounds` interleaved sweeps of CUDA-event medians
(an H100's clocks drift under a long GEMM load). The fused output is checked against the unfused
one on every shape.

    python3 bench/swiglu.py --json swiglu.json

`fuse_mlps` puts the kernel into a model's MLPs for an end-to-end pass:
`bench/extract.py --fused-swiglu`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from typing import Any, Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch
import torch.nn.functional as F

try:                                             # a GPU host's Triton (3.3 or later: TensorDescriptor)
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:
    triton = None

SHAPES = {"hybrid27": (5120, 17408, 64), "dense": (4096, 12288, 36)}     # hidden, intermediate, layers

# The best tile measured (an H100, round 14): BLOCK_M rows of x by BLOCK_N columns of each of
# gate and up (two accumulators), K in BLOCK_K steps.
CONFIG = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": 3, "num_warps": 8}

if triton is not None:
    @triton.jit
    def _tile(tile_id, tiles_m, tiles_n, GROUP_M: tl.constexpr):
        """Tile `tile_id`'s (m, n), in groups of GROUP_M row tiles (x's rows stay in L2)."""
        in_group = GROUP_M * tiles_n
        first_m = (tile_id // in_group) * GROUP_M
        group_m = min(tiles_m - first_m, GROUP_M)
        return first_m + (tile_id % group_m), (tile_id % in_group) // group_m

    @triton.jit
    def _swiglu_kernel(x_desc, g_desc, u_desc, out_desc, M, N, K, STRIDE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr):
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        steps = tl.cdiv(K, BLOCK_K)
        for tile_id in tl.range(tl.program_id(0), tiles_m * tiles_n, STRIDE, flatten=True):
            pid_m, pid_n = _tile(tile_id, tiles_m, tiles_n, GROUP_M)
            m = pid_m * BLOCK_M
            n = pid_n * BLOCK_N
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for step in range(steps):
                k = step * BLOCK_K
                x = x_desc.load([m, k])
                acc_g = tl.dot(x, g_desc.load([n, k]).T, acc_g)
                acc_u = tl.dot(x, u_desc.load([n, k]).T, acc_u)
            g = acc_g.to(out_desc.dtype).to(tl.float32)       # as the GEMMs would write them
            u = acc_u.to(out_desc.dtype).to(tl.float32)
            out_desc.store([m, n], (g * tl.sigmoid(g) * u).to(out_desc.dtype))


def launch(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, config: dict | None = None,
           programs: int | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for 2-D x [M, K] and weights [N, K], one kernel. `programs`:
    the persistent grid's stride (default: one program per multiprocessor; a huge one for one
    tile a program); the grid is that or the tile count, whichever is smaller."""
    c = {**CONFIG, **(config or {})}
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    m, k = x.shape
    n = gate.shape[0]
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if programs is None:
        programs = torch.cuda.get_device_properties(x.device).multi_processor_count
    with torch.cuda.device(x.device):
        _swiglu_kernel[(min(programs, tiles),)](
            TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(gate, [bn, bk]),
            TensorDescriptor.from_tensor(up, [bn, bk]), TensorDescriptor.from_tensor(out, [bm, bn]),
            m, n, k, programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=c["GROUP_M"],
            num_stages=c["num_stages"], num_warps=c["num_warps"])
    return out


_op: Callable | None = None


def op() -> Callable:
    """`launch` as a torch custom op (fleet_bench::swiglu), so torch.compile keeps it whole
    inside a compiled layer instead of tracing into Triton."""
    global _op
    if _op is None:
        @torch.library.custom_op("fleet_bench::swiglu", mutates_args=())
        def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return launch(x, gate, up)

        @swiglu.register_fake
        def _(x, gate, up):
            return x.new_empty((x.shape[0], gate.shape[0]))
        _op = swiglu
    return _op


def fuse_mlps(model: torch.nn.Module) -> str:
    """The kernel in place of every SwiGLU MLP's gate, up and SiLU·mul (before the model's
    layers are compiled: a fused MLP is then traced as one op; marked as the worker's forward,
    so worker.reference.eager sets it aside); what was done."""
    if triton is None:
        raise SystemExit("--fused-swiglu needs Triton 3.3 or later (TensorDescriptor)")
    fused = 0
    for mlp in model.modules():
        if not all(isinstance(getattr(mlp, p, None), torch.nn.Linear) for p in ("gate_proj", "up_proj", "down_proj")):
            continue
        if (type(getattr(mlp, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation")
                or mlp.gate_proj.bias is not None or mlp.up_proj.bias is not None):
            continue                             # not SwiGLU: its own forward
        gate, up, down, swiglu = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj, op()

        def forward(x: torch.Tensor, *args: Any, gate=gate, up=up, down=down, **kwargs: Any) -> torch.Tensor:
            h = swiglu(x.reshape(-1, x.shape[-1]).contiguous(), gate, up)
            return down(h.view(*x.shape[:-1], h.shape[-1]))
        mlp.forward = forward
        mlp._fleet_compiled = True
        fused += 1
    return f"gate·up·SiLU fused in {fused} MLPs"


def configs(quick: bool) -> list[dict]:
    if quick:
        return [CONFIG]
    out = []
    for bn, stages, warps in itertools.product((64, 128), (3, 4), (4, 8)):
        if bn == 128 and warps == 4:                 # two 128×128 fp32 accumulators in 128 threads: spills
            continue
        out.append({"BLOCK_M": 128, "BLOCK_N": bn, "BLOCK_K": 64, "GROUP_M": 8, "num_stages": stages,
                    "num_warps": warps})
    out.append({**CONFIG, "BLOCK_K": 32, "num_stages": 5})
    out.append({**CONFIG, "BLOCK_M": 64, "num_warps": 4})
    return out


def name(c: dict) -> str:
    return f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} s{c['num_stages']} w{c['num_warps']} g{c['GROUP_M']}"


UNFUSED = "unfused (cuBLAS ×2 + Inductor SiLU·mul)"
ONE_GEMM = "gate|up one cuBLAS GEMM + SiLU·mul"


def gate_up(x: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The model's own gate·up·SiLU, as the worker's compiled MLP runs it."""
    return F.silu(F.linear(x, g)) * F.linear(x, u)


def one_gemm(x: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    """The same with gate|up as one GEMM over the two weights concatenated."""
    g, u = F.linear(x, gu).chunk(2, -1)
    return F.silu(g) * u


def main() -> None:
    from bench.extract import interleaved_medians, matmul_peak, median_seconds
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--tokens", default="16384,12000,4096")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="only the best tile measured (CONFIG)")
    args = p.parse_args()
    if triton is None or not torch.cuda.is_available():
        sys.exit("bench/swiglu.py needs a CUDA GPU and Triton 3.3 or later (TensorDescriptor)")
    torch.manual_seed(0)
    peak = matmul_peak()
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": triton.__version__, "peak_tflops": round(peak / 1e12, 1), "shapes": {}}
    unfused = torch.compile(gate_up, dynamic=False)
    one = torch.compile(one_gemm, dynamic=False)
    mlp_unfused = torch.compile(lambda x, g, u, d: F.linear(gate_up(x, g, u), d), dynamic=False)
    cands = configs(args.quick)
    for shape, (h, i, layers) in SHAPES.items():
        gu = torch.randn(2 * i, h, device="cuda", dtype=torch.bfloat16) / h ** 0.5
        g, u = gu[:i], gu[i:]                    # contiguous halves: gate|up as one weight costs nothing
        d = torch.randn(h, i, device="cuda", dtype=torch.bfloat16) / i ** 0.5
        for m in (int(t) for t in args.tokens.split(",")):
            x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
            want = unfused(x, g, u).float()

            def error(got: torch.Tensor) -> float:
                return float((got.float() - want).norm() / want.norm())
            runs = {UNFUSED: lambda: unfused(x, g, u),
                    "two GEMMs alone": lambda: (F.linear(x, g), F.linear(x, u)),
                    ONE_GEMM: lambda: one(x, gu),
                    "mlp unfused (with down)": lambda: mlp_unfused(x, g, u, d),
                    "mlp fused (with down)": lambda: F.linear(launch(x, g, u), d)}
            errors = {ONE_GEMM: error(one(x, gu))}
            for c in cands:
                grids = (None, 1 << 30) if c == CONFIG else (None,)      # persistent; one tile a program
                for programs in grids:
                    key = f"fused {name(c)}" + (" one-tile" if programs else "")
                    try:
                        errors[key] = error(launch(x, g, u, c, programs))
                    except Exception as e:                        # out of shared memory, registers...
                        errors[key] = f"{type(e).__name__}: {str(e)[:160]}"
                        continue
                    runs[key] = (lambda c=c, programs=programs: launch(x, g, u, c, programs))
            seconds = interleaved_medians({k: (lambda fn=fn: median_seconds(fn, args.reps)) for k, fn in runs.items()},
                                          args.rounds)
            rows = {}
            for k, s in seconds.items():
                flops = 2 * 2 * m * h * i * (1.5 if k.startswith("mlp") else 1)
                rows[k] = {"ms": round(s * 1e3, 4), "of_peak": round(flops / s / peak, 3),
                           "ms_per_forward": round(s * 1e3 * layers, 2)}
            fused = {k: v for k, v in rows.items() if k.startswith("fused")}
            best = min(fused, key=lambda k: fused[k]["ms"]) if fused else None
            base = rows[UNFUSED]["ms"]
            result["shapes"][f"{shape} M={m}"] = {
                "rows": rows, "rel_error": errors, "best": best,
                "best_saves_ms_per_forward": round((base - fused[best]["ms"]) * layers, 2) if best else None,
                "one_gemm_saves_ms_per_forward": round((base - rows[ONE_GEMM]["ms"]) * layers, 2),
                "mlp_saves_ms_per_forward": round((rows["mlp unfused (with down)"]["ms"]
                                                   - rows["mlp fused (with down)"]["ms"]) * layers, 2)}
            print(json.dumps({f"{shape} M={m}": {k: (v["ms"], v["of_peak"]) for k, v in rows.items()}}), flush=True)
            with open(args.json, "w") as f:                       # kept if a later shape dies
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
