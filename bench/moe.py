"""Qwen3-30B-A3B's shape on one GPU: what a batch of N tokens gives its experts, where a forward's
time goes, and the fast kernels against today's path, in one process (issue 56).

The model (bench/gpu_fleet.MOE30B: 48 layers, hidden 2,048, 128 experts, 8 a token,
moe_intermediate 768; random bf16 weights built on the GPU), then:

  block : one layer's MoE block (router + experts) on N tokens, for each N of --tokens:
          transformers' grouped_mm path eager and compiled (as the worker's compiled layers run it),
          the torch grouped GEMMs alone (the up and down projections on rows already sorted by
          expert: today's GEMM ceiling), and where quack-kernels imports, the experts on quack's
          grouped GEMMs (worker.kernels: gathered A rows, SwiGLU epilogue), each against the eager
          block's output (relative error);
  model : the whole model's forward, its layers compiled (worker.model.compile_layers) at the
          batch shapes of --shapes (rows x width), today's path and the fast one, with
          % of the peak counting the active parameters (worker.model.active_parameters);
  profile: one of those forwards under the profiler, kernel time by family (--profile).

Figures: CUDA-event medians; the peak an 8192^3 bf16 product, median of 10, in the same process.

    python3 bench/moe.py --json moe.json --profile
    python3 bench/moe.py --cpu-smoke          # a tiny shape on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

DEVICE = "cuda"
T0 = time.time()


def log(**kw) -> None:
    print(json.dumps({"t": round(time.time() - T0, 1), **kw}), flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def seconds(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of `fn` (CUDA events on a GPU, the wall clock on a CPU)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        if DEVICE == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            sync()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def config(tiny: bool):
    from transformers import AutoConfig

    from bench.gpu_fleet import MOE30B
    shape = {k: v for k, v in MOE30B.items() if k not in ("architectures", "torch_dtype")}
    if tiny:
        shape.update(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_experts=16, num_experts_per_tok=4,
                     moe_intermediate_size=32, intermediate_size=96)
    return AutoConfig.for_model(**shape)


def block_bench(model, cfg, tokens: list[int], peak: float, fast, result: dict, deadline: float) -> None:
    """One MoE block on N tokens: the paths above, ms and TFLOP/s of the experts' active FLOPs."""
    from worker.kernels import grouped_forward, routed_groups
    from worker.model import find_decoder
    block = find_decoder(model).layers[0].mlp
    experts = block.experts
    H, I, E, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
    compiled = torch.compile(type(block).forward, dynamic=True)
    out = result.setdefault("block", {})
    for n in tokens:
        if time.time() > deadline:
            out[n] = "skipped: time"
            continue
        g = torch.Generator(device=DEVICE).manual_seed(n)
        x = torch.randn((n, H), generator=g, device=DEVICE, dtype=torch.bfloat16)
        flops = 2 * n * k * 3 * H * I
        row: dict = {"tokens": n, "rows_per_expert": n * k / E}
        with torch.inference_mode():
            want = block(x.view(1, n, H))
            t = seconds(lambda: block(x.view(1, n, H)))
            row["grouped_mm_eager_ms"], row["grouped_mm_eager_tflops"] = round(t * 1e3, 3), round(flops / t / 1e12, 1)
            got = compiled(block, x.view(1, n, H))
            t = seconds(lambda: compiled(block, x.view(1, n, H)))
            row["grouped_mm_compiled_ms"], row["grouped_mm_compiled_tflops"] = round(t * 1e3, 3), round(flops / t / 1e12, 1)
            row["compiled_rel_err"] = rel(got, want)
            # today's GEMMs alone: rows sorted by expert, the two grouped products
            _, weights, index = block.gate(x)
            order, cu, rows = routed_groups(index, E)
            offs = cu[1:].contiguous()
            a = x[rows.long()]
            mm = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
            up_w, down_w = experts.gate_up_proj.transpose(-2, -1), experts.down_proj.transpose(-2, -1)
            mid = torch.randn((a.shape[0], I), device=DEVICE, dtype=torch.bfloat16)
            if DEVICE == "cuda":
                t_up = seconds(lambda: mm(a, up_w, offs=offs))
                t_down = seconds(lambda: mm(mid, down_w, offs=offs))
                row["torch_grouped_gemms_ms"] = round((t_up + t_down) * 1e3, 3)
                row["torch_grouped_gemms_tflops"] = round(flops / (t_up + t_down) / 1e12, 1)
                row["torch_grouped_up_tflops"] = round(2 * n * k * 2 * H * I / t_up / 1e12, 1)
                row["torch_grouped_down_tflops"] = round(2 * n * k * H * I / t_down / 1e12, 1)
            if fast is not None:
                forward = grouped_forward(*fast)

                def run_fast():
                    _, w, i = block.gate(x)
                    return forward(experts, x, i, w)
                try:
                    got = run_fast()
                    row["fast_rel_err"] = rel(got.view_as(want), want)
                    t = seconds(run_fast)
                    row["fast_ms"], row["fast_tflops"] = round(t * 1e3, 3), round(flops / t / 1e12, 1)
                    swiglu, plain = fast
                    t_up = seconds(lambda: swiglu(x, experts.gate_up_proj, cu, rows))
                    t_down = seconds(lambda: plain(mid, experts.down_proj, cu))
                    row["fast_gemms_ms"] = round((t_up + t_down) * 1e3, 3)
                    row["fast_up_swiglu_tflops"] = round(2 * n * k * 2 * H * I / t_up / 1e12, 1)
                    row["fast_down_tflops"] = round(2 * n * k * H * I / t_down / 1e12, 1)
                except Exception as e:
                    row["fast_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc()
        out[n] = row
        log(block=row)
        del x, want, got, a, mid
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        result["peak_tflops"] = round(peak / 1e12, 1)


def model_bench(model, cfg, shapes: list[tuple[int, int]], peak: float, active: int, label: str, result: dict,
                deadline: float, profile: tuple[int, int] | None = None) -> None:
    """Whole forwards at each (rows, width), the layers compiled: ms, tokens/s, % of the peak
    counting the active parameters; and one shape under the profiler."""
    from worker.model import unpacked_rows
    out = result.setdefault("model", {}).setdefault(label, {})
    for rows, width in shapes:
        if time.time() > deadline:
            out[f"{rows}x{width}"] = "skipped: time"
            continue
        ids = torch.randint(0, cfg.vocab_size, (rows, width), device=DEVICE,
                            generator=torch.Generator(device=DEVICE).manual_seed(rows * width))
        with torch.inference_mode(), unpacked_rows():
            t = seconds(lambda: model(input_ids=ids, use_cache=False), reps=5, warmup=2)
        tps = rows * width / t
        out[f"{rows}x{width}"] = row = {"ms": round(t * 1e3, 1), "tokens_per_s": round(tps),
                                        "active_mfu": round(2 * active * tps / peak, 4)}
        log(model=label, shape=f"{rows}x{width}", **row)
    if profile and time.time() < deadline:
        from bench.extract import kernel_summary
        from torch.profiler import ProfilerActivity, profile as prof
        rows, width = profile
        ids = torch.randint(0, cfg.vocab_size, (rows, width), device=DEVICE)
        with torch.inference_mode(), unpacked_rows():
            model(input_ids=ids, use_cache=False)
            sync()
            with prof(activities=[ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU]) as p:
                for _ in range(3):
                    model(input_ids=ids, use_cache=False)
                sync()
        field = "self_device_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
        kernels = [(e.key, getattr(e, field, 0), e.count) for e in p.key_averages()]
        total = sum(t for _, t, _ in kernels if t > 0)
        summary = kernel_summary(kernels, top=25)
        result.setdefault("profile", {})[label] = {"shape": [rows, width], "gpu_ms_per_forward": round(total / 3 / 1e3, 2),
                                                   **summary}
        log(profile=label, gpu_ms=round(total / 3 / 1e3, 2), share=summary["share"],
            top=[(k["kernel"][:70], k["share"]) for k in summary["top"][:12]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--tokens", default="4096,8192,16384,32768,65536", help="MoE block sizes (tokens)")
    p.add_argument("--shapes", default="16x1024,32x1024,64x1024", help="whole-model batches, rows x width")
    p.add_argument("--profile", action="store_true", help="profile the first --shapes batch of each path")
    p.add_argument("--skip-fast", action="store_true", help="today's path only")
    p.add_argument("--skip-block", action="store_true")
    p.add_argument("--budget-s", type=float, default=480, help="stop starting new steps after this many seconds")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU: checks the script runs")
    args = p.parse_args()
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"
    deadline = T0 + args.budget_s
    from worker.kernels import quack_missing, quack_gemms, torch_gemms
    from worker.kernels import use_fast_kernels
    from worker.model import active_parameters, compile_layers, uncompile_layers
    result: dict = {"gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                    "transformers": __import__("transformers").__version__}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    if DEVICE == "cuda":
        n = 8192
        a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
        peak = 2 * n ** 3 / seconds(lambda: a @ b)
        del a, b
    else:
        peak = 1e12
    result["peak_tflops"] = round(peak / 1e12, 1)
    log(peak_tflops=result["peak_tflops"], gpu=result["gpu"])
    cfg = config(args.cpu_smoke)
    from transformers import AutoModel
    torch.manual_seed(0)
    t = time.time()
    with torch.device(DEVICE):
        model = AutoModel.from_config(cfg, dtype=torch.bfloat16).eval()
    total, active = active_parameters(model)
    result.update(model_init_s=round(time.time() - t, 1), nonembedding_params=total, active_params=active,
                  experts_implementation=getattr(model.config, "_experts_implementation", None))
    log(init_s=result["model_init_s"], total=total, active=active)
    why = "--skip-fast" if args.skip_fast else (None if args.cpu_smoke else quack_missing(torch.device(DEVICE)))
    fast = None
    if why is None:
        try:
            fast = torch_gemms() if args.cpu_smoke else quack_gemms()
        except Exception as e:
            why = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
    result["fast"] = "quack" if fast and not args.cpu_smoke else ("torch loop (smoke)" if fast else why)
    log(fast=result["fast"])
    save()
    if not args.skip_block:
        try:
            block_bench(model, cfg, [int(x) for x in args.tokens.split(",")], peak, fast, result, deadline)
        except Exception as e:
            result["block_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
        save()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    compile_layers(model)
    model_bench(model, cfg, shapes, peak, active, "grouped_mm", result, deadline,
                shapes[0] if args.profile else None)
    save()
    if fast is not None:
        uncompile_layers(model)
        try:
            result["fast_note"] = use_fast_kernels(model, torch.device(DEVICE), lambda: fast,
                                                  "torch" if args.cpu_smoke else "quack")
            log(fast_note=result["fast_note"])
            compile_layers(model)
            model_bench(model, cfg, shapes, peak, active, "fast", result, deadline,
                        shapes[0] if args.profile else None)
        except Exception as e:
            result["fast_model_error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc()
    save()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
