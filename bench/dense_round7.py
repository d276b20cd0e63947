"""Where the dense bench shape's GPU time goes, and what each change to the worker's path buys
(issue 26, round 7). One process, one model (bench/extract.py's dense shape, compiled layers):

  gemm     : each projection of a decoder layer alone at M tokens (and q|k|v, gate|up fused), in
             TFLOP/s against the measured matmul peak: the ceiling the matmuls themselves set;
  sdpa     : causal GQA attention at the bench's widths through each SDPA backend;
  syncs    : the GPU-to-host syncs in one forward (torch's sync debug mode), with and without
             worker.model.unpacked_rows;
  forward  : the compiled forward of one batch shape, alone (no capture, no writer), as MFU;
  profile  : GPU kernel time by family over a real extraction pass (run_extraction, the worker's
             loop) and the share of that pass the GPU sat idle;
  variants : the bench pass (bench/extract.py's `ours`, 1,200 rows to local disk) with and
             without the packed-sequence search, each checked against the model's own eager
             forward (bs=1, no compile).

    python3 bench/dense_round7.py --json out.json [--variants greedy_sync,greedy] [--skip-micro]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch
import torch._dynamo

import bench.extract as ex
from worker.batching import make_batches
from worker.layers import resolve_layers
from worker.model import Capture, compile_layers, find_decoder

# name -> (without transformers' packed-sequence search (worker.model.unpacked_rows), token budget)
VARIANTS = {
    "greedy_sync": (False, 16384),                 # the worker before round 7: one host sync a batch
    "greedy": (True, 16384),                       # the worker now
    "greedy_again": (True, 16384),
    "greedy_sync_again": (False, 16384),
}


DEV = "cuda"


def timed(fn, reps: int = 10) -> float:
    if DEV == "cpu":
        for _ in range(2):
            fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return ex.median_seconds(fn, reps, warmup=2)


def gemms(layer, peak: float, ms=(16384, 8192)) -> dict:
    a, m = layer.self_attn, layer.mlp
    ws = {"q": a.q_proj.weight, "k": a.k_proj.weight, "v": a.v_proj.weight, "o": a.o_proj.weight,
          "gate": m.gate_proj.weight, "up": m.up_proj.weight, "down": m.down_proj.weight}
    ws["qkv"] = torch.cat([ws["q"], ws["k"], ws["v"]])
    ws["gate_up"] = torch.cat([ws["gate"], ws["up"]])
    out = {}
    for M in ms:
        row = {}
        for name, w in ws.items():
            x = torch.randn(M, w.shape[1], device=DEV, dtype=torch.bfloat16)
            t = timed(lambda: torch.nn.functional.linear(x, w))
            row[name] = {"ms": round(t * 1e3, 3), "of_peak": round(2 * M * w.numel() / t / peak, 3)}
        sep = sum(row[k]["ms"] for k in ("q", "k", "v", "o", "gate", "up", "down"))
        fused = sum(row[k]["ms"] for k in ("qkv", "o", "gate_up", "down"))
        flops = 2 * M * sum(ws[k].numel() for k in ("q", "k", "v", "o", "gate", "up", "down"))
        row["layer_separate"] = {"ms": round(sep, 3), "of_peak": round(flops / (sep / 1e3) / peak, 3)}
        row["layer_fused"] = {"ms": round(fused, 3), "of_peak": round(flops / (fused / 1e3) / peak, 3)}
        out[M] = row
    return out


def sdpa(peak: float) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    F = torch.nn.functional
    out = {}
    for rows, S in ((16, 1024), (8, 2048), (4, 4096), (2, 8192)):
        q = torch.randn(rows, 32, S, 128, device=DEV, dtype=torch.bfloat16)
        k = torch.randn(rows, 8, S, 128, device=DEV, dtype=torch.bfloat16)
        v = torch.randn(rows, 8, S, 128, device=DEV, dtype=torch.bfloat16)
        flops = 4 * rows * 32 * S * S * 128 / 2
        row = {}
        try:
            row["default_choice"] = int(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=True))
        except Exception as e:
            row["default_choice"] = str(e)[:80]
        for name in ("default", "FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            def run():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            try:
                if name == "default":
                    t = timed(run)
                else:
                    with sdpa_kernel([getattr(SDPBackend, name)]):
                        t = timed(run)
                row[name] = {"ms": round(t * 1e3, 3), "tflops": round(flops / t / 1e12, 1)}
            except Exception as e:
                row[name] = str(e).splitlines()[0][:120]
        out[f"{rows}x{S}"] = row
    return out


def host_syncs(base, around) -> list:
    """The GPU-to-host syncs in one forward (torch's sync debug mode), each with where it came from."""
    import warnings
    if DEV != "cuda":
        return []
    ids = torch.randint(0, 32000, (4, 256), device=DEV)
    with torch.inference_mode(), around():
        base(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                base(input_ids=ids, use_cache=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    out = []
    for w in caught:
        out.append(str(w.message).splitlines()[0][:100] + f" @ {os.path.basename(w.filename)}:{w.lineno}")
    return out


def eager_refs(base, samples, plan) -> list:
    refs = []
    with torch.inference_mode():
        for s in samples:
            out = base(input_ids=torch.from_numpy(s.input_ids)[None].to(DEV), output_hidden_states=True)
            refs.append(torch.stack([out.hidden_states[i][0] for i in plan.ids[:-1]], dim=1).float())
    return refs


def check(base, samples, plan, refs) -> float:
    """The batched capture (the worker's hooks, this path) against the eager bs=1 forward."""
    capture = Capture(find_decoder(base), plan)
    with torch.inference_mode():
        width = max(s.length for s in samples)
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        for r, s in enumerate(samples):
            ids[r, : s.length] = torch.from_numpy(s.input_ids)
            ids[r, s.length:] = int(s.input_ids[-1])
        base(input_ids=ids.to(DEV), use_cache=False)
        got = capture.take().float()
    capture.remove()
    return max(float((got[r, : s.length, :-1] - ref).norm() / ref.norm()) for r, (s, ref) in
               enumerate(zip(samples, refs)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--variants", default="greedy_sync,greedy,greedy_again,greedy_sync_again")
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--disk", default="/tmp")
    p.add_argument("--skip-micro", action="store_true")
    p.add_argument("--profile-samples", type=int, default=400)
    p.add_argument("--profile", default="greedy_sync,greedy", help="variants whose pass is also profiled")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU: checks the script runs")
    args = p.parse_args()
    global DEV
    if args.cpu_smoke:
        DEV = ex.DEVICE = "cpu"
        args.skip_micro = True
        torch._dynamo.config.disable = True           # the flow, not Inductor's CPU backend
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    res: dict = {"gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", "torch": torch.__version__,
                 "transformers": __import__("transformers").__version__,
                 "cudnn": torch.backends.cudnn.version()}

    def save():
        json.dump(res, open(args.json, "w"), indent=1)
    peak = ex.matmul_peak() if DEV == "cuda" else 1e12
    res["peak_tflops"] = round(peak / 1e12, 1)
    config = ex.make_config("dense", 32000, tiny=args.cpu_smoke)
    if args.cpu_smoke:
        args.samples = min(args.samples, 60)
    with torch.device(DEV):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    base = lm.model
    params = sum(p.numel() for p in base.parameters()) - base.get_input_embeddings().weight.numel()
    plan = resolve_layers("speculators", config.num_hidden_layers)
    samples = ex.make_samples(args.samples, 32000, 1, 8192)
    warm = ex.make_samples(40, 32000, 3, 8192)
    refs = eager_refs(base, warm[:8], plan)
    res["eager_check"] = check(base, warm[:8], plan, refs)
    if not args.skip_micro:
        with torch.inference_mode():
            res["gemm"] = gemms(find_decoder(base).layers[0], peak)
            res["sdpa"] = sdpa(peak)
        save()
        print(json.dumps({"gemm": res["gemm"], "sdpa": res["sdpa"]}), flush=True)
    import contextlib

    import worker.extractor as wx          # the GPU loop lives there (worker/extract.py split)
    from worker.model import unpacked_rows
    compile_layers(base)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for rows, width in ((2, 16), (1, 8)):
            base(input_ids=torch.zeros((rows, width), dtype=torch.long, device=DEV), use_cache=False)
    ex.sync()
    res["compile_s"] = round(time.perf_counter() - t0, 1)
    res["syncs"] = {"with_search": host_syncs(base, contextlib.nullcontext),
                    "unpacked_rows": host_syncs(base, unpacked_rows)}
    ids = torch.randint(0, 32000, (16, 1024) if DEV == "cuda" else (2, 64), device=DEV)
    with torch.inference_mode(), unpacked_rows():
        t = timed(lambda: base(input_ids=ids, use_cache=False), reps=5)
    res["forward_16x1024_mfu"] = round(2 * params * ids.numel() / t / peak, 4)
    print("syncs", res["syncs"], "forward mfu", res["forward_16x1024_mfu"], flush=True)
    for name in args.variants.split(","):
        nosync, budget = VARIANTS[name]
        v: dict = {"unpacked_rows": nosync, "budget": budget}
        wx.unpacked_rows = unpacked_rows if nosync else contextlib.nullcontext
        with (unpacked_rows if nosync else contextlib.nullcontext)():
            v["check_vs_eager"] = check(base, warm[:8], plan, refs)
        d = tempfile.mkdtemp(dir=args.disk, prefix="r7-")
        ex.ours(base, warm, plan, d, budget)                      # allocator, shapes
        if name in args.profile.split(","):
            res["profile_" + name] = ex.profile_pass(base, samples[: args.profile_samples], plan, d, budget)
            shutil.rmtree(d)
            d = tempfile.mkdtemp(dir=args.disk, prefix="r7-")
        r = ex.rate(ex.ours(base, samples, plan, d, budget), params, peak)
        shutil.rmtree(d)
        v.update(r)
        v["batches"] = len(make_batches(samples, budget, 8))
        res[name] = v
        save()
        print(name, json.dumps(v), flush=True)
    wx.unpacked_rows = unpacked_rows
    print(f"peak {res['peak_tflops']}")
    for name in args.variants.split(","):
        v = res[name]
        print(f"{name:<16}{v['tokens_per_s']:>8}{v['mfu']:>8.1%}  "
              f"check {v['check_vs_eager']:.2e}  batches {v['batches']}")


if __name__ == "__main__":
    main()
