"""Throughput of hidden-state extraction on one GPU: the naive approach against the worker's path.

Random-initialised decoders of real shape (dense qwen3: 36 layers, hidden 4096, ~7B non-embedding
parameters; and a qwen3_5_text hybrid of the same size), ShareGPT-like lengths (lognormal, mean 728
tokens). In one process: a bf16 matmul peak, then for each shape

  naive : batch 1, output_hidden_states=True through the causal LM (logits computed), the chosen
          layers stacked, .cpu(), safetensors written synchronously;
  ours  : worker.extract.run_extraction (sorted batches under a token budget, hooks, side-stream
          copies, background writer) writing to local disk, and again to tmpfs (/dev/shm);
          eager, and with the decoder layers compiled (worker.model.compile_layers, dynamic shapes:
          the compile is timed on its own, as the worker does it at load);
  disk  : the raw write bandwidth of each folder (files of one sample's size, fsync'd, by as many
          threads as the writer uses), against the bytes per second the extraction needs.

The first 60 s of each run are reported apart (hybrid models tune kernels per shape at first).

Prints a table and writes JSON (``--json``). MFU = 2 x non-embedding parameters x tokens/s / peak.

    python bench/extract.py --shape dense --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np
import torch

from bench.window import window_lengths
from worker.batching import make_batches, padding_share
from worker.data import Sample
from worker.demo import sharegpt_lengths
from worker.events import EventLog
from worker.extract import Options, run_extraction
from worker.gdn import linear_attention_layers
from worker.layers import resolve_layers
from worker.model import Capture, compile_layers, find_decoder, uncompile_layers
from worker.probe import timed_writes
from worker.writer import SPECULATORS, Stats, write_sample_file


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn, reps: int = 10, warmup: int = 3) -> float:
    """The median of `reps` calls of `fn` on the GPU, each timed by CUDA events, after `warmup`."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        sync()
        times.append(s.elapsed_time(e) / 1e3)
    return sorted(times)[len(times) // 2]


def interleaved_medians(measures: dict, rounds: int) -> dict[str, float]:
    """Each measure (a function returning seconds) taken once per round, the rounds interleaved,
    then its median over the rounds: an H100's clocks drift under a long GEMM load (identical
    shapes differed by 7% when timed minutes apart), so every figure is spread through the sweep."""
    seconds: dict = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            seconds[name].append(measure())
    return {name: sorted(s)[len(s) // 2] for name, s in seconds.items()}


def matmul_peak() -> float:
    n = 8192
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    return 2 * n ** 3 / median_seconds(lambda: a @ b)


def make_config(shape: str, vocab: int, tiny: bool = False):
    from transformers import AutoConfig
    common = dict(vocab_size=vocab, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                  max_position_embeddings=32768, tie_word_embeddings=False)
    if tiny:                                       # --cpu-smoke: the same code paths, in seconds
        common.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    if shape == "dense":
        return AutoConfig.for_model("qwen3", **common)
    if shape == "hybrid27" and not tiny:           # the users' 27B hybrid (bench/gpu_fleet.py's shape)
        from bench.gpu_fleet import HYBRID27
        return AutoConfig.for_model(**{**{k: v for k, v in HYBRID27.items() if k != "architectures"},
                                       "vocab_size": vocab})
    if shape == "moe30b":                          # Qwen3-30B-A3B's shape (bench/gpu_fleet.py's MOE30B)
        from bench.gpu_fleet import MOE30B
        moe = {**{k: v for k, v in MOE30B.items() if k != "architectures"}, "vocab_size": vocab}
        if tiny:
            moe.update(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32)
        return AutoConfig.for_model(**moe)
    types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(common["num_hidden_layers"])]
    return AutoConfig.for_model("qwen3_5_text", layer_types=types, linear_num_key_heads=16,
                                linear_num_value_heads=32, linear_key_head_dim=128,
                                linear_value_head_dim=128, **common)


def make_samples(n: int, vocab: int, seed: int, max_len: int, window: int = 0, budget: int = 16384,
                 pad: int = 8) -> list[Sample]:
    """About `n` random-id rows: ShareGPT-like lengths, or with `window` the rows of every k-th
    batch of one sort window of that many rows (bench/window.py: a real shard's padding)."""
    lengths = (window_lengths(seed, n, budget, pad, window=window, max_len=max_len) if window
               else [min(length, max_len) for length in sharegpt_lengths(random.Random(seed), n, 728)])
    out = []
    for i, length in enumerate(lengths):
        ids = np.random.default_rng(seed + i).integers(0, vocab, length, dtype=np.int64)
        out.append(Sample(i, ids, np.ones(length, dtype=np.uint8)))
    return out


def naive(lm, samples, plan, out_dir) -> dict:
    sync()
    t0 = time.perf_counter()
    tokens = 0
    with torch.inference_mode():
        for s in samples:
            ids = torch.from_numpy(s.input_ids)[None].to(DEVICE)
            out = lm(input_ids=ids, output_hidden_states=True)
            hs = torch.stack([out.hidden_states[i][0] for i in plan.ids], dim=1).cpu()
            write_sample_file(SPECULATORS, out_dir, s.index,
                              {"hidden_states": hs, "token_ids": torch.from_numpy(s.input_ids)}, {})
            tokens += s.length
    sync()
    return {"seconds": time.perf_counter() - t0, "tokens": tokens, "samples": len(samples)}


def ours(base, samples, plan, out_dir, budget, pad=8, first_s=60.0, bucket_rows=False) -> dict:
    stats = Stats()
    log = EventLog(None, 0)
    first: dict = {}
    done = threading.Event()

    def sample_first() -> None:                   # tokens written in the first `first_s` seconds
        if not done.wait(first_s):
            first["tokens"] = stats.snapshot()["tokens"]
    sync()
    t0 = time.perf_counter()
    sampler = threading.Thread(target=sample_first, daemon=True)
    sampler.start()
    run_extraction(base, [samples], plan, out_dir, 0, torch.device(DEVICE),
                   Options(max_tokens_per_batch=budget, writer_queue=3, writer_threads=8, pad_multiple=pad,
                           bucket_rows=bucket_rows),
                   log, stats, progress_interval=1e9, total=len(samples))
    sync()
    done.set()
    snap = stats.snapshot()
    out = {"seconds": time.perf_counter() - t0, "tokens": snap["tokens"], "samples": snap["done"],
           "writer_wait_s": snap["writer_wait_s"], "bytes": snap["bytes"]}
    if "tokens" in first:
        out["first_s_tokens_per_s"] = round(first["tokens"] / first_s)
    return out


def disk_bandwidth(root: str, file_bytes: int, total_bytes: int, threads: int = 8) -> float:
    """Bytes per second written to `root` as the writer writes: one file per sample, fsync'd."""
    n = max(total_bytes // file_bytes, threads)
    return n * file_bytes / timed_writes(root, file_bytes, n, threads)


def reference_error(lm, base, samples, plan, aside: bool = False) -> float:
    """Largest relative error of our batched capture against a bs=1 output_hidden_states forward;
    `aside`: that forward with the worker's own forwards set aside (worker.reference.eager), as
    the worker's reference checks run it."""
    from worker.reference import eager
    capture = Capture(find_decoder(base), plan)
    worst = 0.0
    with torch.inference_mode():
        batch = samples[:8]
        width = max(s.length for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        for r, s in enumerate(batch):
            ids[r, : s.length] = torch.from_numpy(s.input_ids)
        base(input_ids=ids.to(DEVICE), use_cache=False)
        got = capture.take().float()
        for r, s in enumerate(batch):
            with eager(base) if aside else contextlib.nullcontext():
                out = lm.model(input_ids=torch.from_numpy(s.input_ids)[None].to(DEVICE), output_hidden_states=True)
            hs = list(out.hidden_states)
            ref = torch.stack([hs[i][0] for i in plan.ids], dim=1).float()
            if plan.last_layer_norm == "pre":     # hs[L] from transformers is post-norm; ours is pre
                ref = ref[:, :-1]
                g = got[r, : s.length, :-1]
            else:
                g = got[r, : s.length]
            worst = max(worst, float((g - ref).norm() / ref.norm()))
    capture.remove()
    return worst


def compile_hybrid_layers(model: torch.nn.Module) -> int:
    """Hybrid models, another way than worker.model.compile_regions: whole decoder layers compiled, each Gated
    DeltaNet block kept out of the graph (torch.compiler.disable: a graph break around it, so
    dynamo never traces into fla's Triton kernels) with its gated norm compiled alone. The
    residual adds then fuse with the norms after them, which compile_regions leaves eager
    between its regions (1.5% of the 27B's forward on an H100). Returns the modules compiled."""
    import functools

    import torch._dynamo
    from worker.model import _compile_forwards
    decoder = find_decoder(model)
    blocks = linear_attention_layers(model)
    norms = [m for b in blocks for m in b.children() if type(m).__name__.endswith("RMSNormGated")
             and "forward" not in m.__dict__]
    n = _compile_forwards(norms, 2 * len(norms) + 16)
    for block in blocks:
        forward = block.__dict__.get("forward") or functools.partial(type(block).forward, block)
        block.forward = torch._dynamo.disable(forward)
        block._fleet_compiled = True
    compile_layers(model)
    return n + len(decoder.layers)


# Kernel families by name, first match wins: Inductor's fused kernels are all "triton_"; cuDNN's
# attention kernels hold "sm90_" like the GEMMs, so attention comes before matmul.
FAMILIES = (("copy", ("memcpy", "memset", "direct_copy")), ("inductor", ("triton_",)),
            ("attention", ("flash", "fmha", "sdpa", "cudnn_generated", "attention")),
            ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "swiglu")), ("conv", ("conv",)),
            ("fla", ("chunk", "recompute", "fwd_kernel", "l2norm", "delta", "solve_tril", "cumsum")))


def family(kernel: str) -> str:
    low = kernel.lower()
    return next((f for f, keys in FAMILIES if any(k in low for k in keys)), "other")


def kernel_summary(kernels: list[tuple[str, float, int]], top: int = 30) -> dict:
    """(name, µs, calls) of each kernel: the share of each family and the `top` kernels by time."""
    kernels = [k for k in kernels if k[1] > 0]
    total = sum(t for _, t, _ in kernels) or 1.0
    by_family = {f: 0.0 for f, _ in (*FAMILIES, ("other", ()))}
    for name, t, _ in kernels:
        by_family[family(name)] += t
    return {"share": {f: round(t / total, 3) for f, t in by_family.items()},
            "top": [{"kernel": name[:120], "ms": round(t / 1e3, 2), "calls": c, "share": round(t / total, 3)}
                    for name, t, c in sorted(kernels, key=lambda k: -k[1])[:top]]}


def profile_forward(base, n: int, vocab: int, rows: int = 16, width: int = 1024) -> dict:
    """Where a forward's GPU time goes: kernels by total time (top 30), and the time in each
    family (matmuls, flash-linear-attention's Triton kernels, convolutions, attention, the rest);
    with the forwards' wall time unprofiled, so the GPU's idle share (host-bound gaps) shows."""
    from torch.profiler import ProfilerActivity, profile
    from worker.model import unpacked_rows
    ids = torch.randint(0, vocab, (rows, width), device=DEVICE)
    with torch.inference_mode(), unpacked_rows():         # as the worker's forwards run
        for _ in range(3):
            base(input_ids=ids, use_cache=False)
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            base(input_ids=ids, use_cache=False)
        sync()
        wall = (time.perf_counter() - t0) / n
        with profile(activities=[ProfilerActivity.CUDA if DEVICE == "cuda" else ProfilerActivity.CPU]) as prof:
            for _ in range(n):
                base(input_ids=ids, use_cache=False)
            sync()
    field = "self_device_time_total" if DEVICE == "cuda" else "self_cpu_time_total"
    kernels = [(e.key, getattr(e, field, 0) or getattr(e, "self_cuda_time_total", 0), e.count)
               for e in prof.key_averages()]
    total = sum(t for _, t, _ in kernels if t > 0)
    return {"shape": [rows, width], "forwards": n, "tokens": rows * width * n,
            "wall_ms_per_forward": round(wall * 1e3, 2), "gpu_ms_per_forward": round(total / n / 1e3, 2),
            **kernel_summary(kernels)}


def profile_pass(base, samples, plan, out_dir: str, budget: int, pad: int = 8, bucket_rows: bool = False) -> dict:
    """A real extraction pass (`ours`) under the profiler: its wall time, the share of it the GPU
    was busy (any kernel or copy on any stream), its idle gaps over 100 µs, and kernel time by
    family, so a pass's rate can be set against the forward's alone."""
    from torch.profiler import ProfilerActivity, profile
    trace = os.path.join(tempfile.gettempdir(), f"pass-trace-{os.getpid()}.json")
    with profile(activities=[ProfilerActivity.CUDA] if DEVICE == "cuda" else [ProfilerActivity.CPU]) as prof:
        r = ours(base, samples, plan, out_dir, budget, pad, bucket_rows=bucket_rows)
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    os.remove(trace)
    cats = ("kernel", "gpu_memcpy", "gpu_memset") if DEVICE == "cuda" else ("cpu_op",)
    work = [e for e in events if e.get("cat") in cats and "dur" in e]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in work)
    busy, end, gaps = 0.0, None, []
    for a, b in spans:                          # the union of the spans, and the holes between them
        if end is None or a > end:
            if end is not None:
                gaps.append(a - end)
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    window = (spans[-1][1] - spans[0][0]) if spans else 1.0
    times: dict = {}
    for e in work:
        name = e["name"]
        t, c = times.get(name, (0.0, 0))
        times[name] = (t + float(e["dur"]), c + 1)
    long_gaps = [g for g in gaps if g > 100]
    return {"tokens": r["tokens"], "seconds": round(r["seconds"], 2), "writer_wait_s": r["writer_wait_s"],
            "gpu_window_s": round(window / 1e6, 3), "gpu_busy_share": round(busy / window, 4),
            "gaps_over_100us": len(long_gaps), "gap_s_over_100us": round(sum(long_gaps) / 1e6, 3),
            "largest_gaps_ms": [round(g / 1e3, 1) for g in sorted(long_gaps)[-10:]],
            **kernel_summary([(k, t, c) for k, (t, c) in times.items()])}


def check_fla_conv(base) -> dict:
    """Swap in fla's convolution (worker.model.use_fla_conv) and compare one layer's short
    convolution with transformers' reference on the same input."""
    import torch.nn.functional as F

    from worker.model import fla_causal_conv1d, use_fla_conv
    layer = linear_attention_layers(base)[0]
    conv = layer.conv1d
    x = torch.randn(4, conv.weight.shape[0], 777, device=DEVICE, dtype=torch.bfloat16)
    want = F.silu(F.conv1d(x, conv.weight, conv.bias, padding=conv.weight.shape[-1] - 1,
                           groups=conv.weight.shape[0])[:, :, :x.shape[-1]])
    fn = fla_causal_conv1d()
    got = fn(x, conv.weight.squeeze(1), conv.bias, activation="silu") if fn else None
    err = float((got.float() - want.float()).norm() / want.float().norm()) if fn else None
    return {"available": fn is not None, "rel_err_vs_reference": err, "took": use_fla_conv(base)}


def check_fla_norms(base, vocab: int) -> dict:
    """Swap in fla's fused RMS norms (worker.model.use_fla_norms) and compare the whole model's
    hidden states with its own norms', on the same 2 x 1,000 tokens."""
    from worker.model import use_fla_norms
    ids = torch.randint(0, vocab, (2, 1000), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(5))
    with torch.inference_mode():
        before = [h.float() for h in base(input_ids=ids, output_hidden_states=True).hidden_states]
        took = use_fla_norms(base)
        after = [h.float() for h in base(input_ids=ids, output_hidden_states=True).hidden_states]
    errs = [float((a - b).norm() / b.norm()) for a, b in zip(after, before)]
    return {"took": took, "max_rel_err_vs_own_norms": max(errs), "last_layer_rel_err": errs[-1]}


def conv_source(base) -> list[str]:
    """How this transformers' linear-attention layer runs its short convolution (the lines of its
    module that name it): which kernel a hybrid model gets here."""
    import inspect
    layer = next(iter(linear_attention_layers(base)), None)
    if layer is None:
        return []
    src = inspect.getsource(inspect.getmodule(type(layer)))
    return [f"{i}: {l.strip()}" for i, l in enumerate(src.splitlines(), 1) if "conv1d" in l][:60]


def track_tuning(log: list) -> None:
    """Record every Triton autotuning run (fla's kernels tune on first sight of a key): kernel,
    key, seconds, and when (perf_counter), by wrapping the Autotuner's run."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:                              # no Triton (the CPU smoke test): nothing tunes
        return
    run = Autotuner.run

    def tracked(self, *args, **kwargs):
        n = len(self.cache)
        t0 = time.perf_counter()
        out = run(self, *args, **kwargs)
        if len(self.cache) > n:
            fn = getattr(self, "base_fn", None) or getattr(self, "fn", None)
            log.append({"kernel": getattr(fn, "__name__", str(fn))[:60], "key": str(list(self.cache)[-1])[:160],
                        "s": round(time.perf_counter() - t0, 3), "t": round(t0, 2)})
        return out
    Autotuner.run = tracked


def rate(r: dict, params: int, peak: float) -> dict:
    tps = r["tokens"] / r["seconds"]
    return dict(r, tokens_per_s=round(tps), samples_per_s=round(r["samples"] / r["seconds"], 2),
                mfu=round(2 * params * tps / peak, 4))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("dense", "hybrid", "hybrid27", "moe30b"), default="dense",
                   help="the 7B dense or 7.8B hybrid bench shapes, the 27B hybrid (64 layers, hidden 5,120), or "
                        "Qwen3-30B-A3B's MoE shape (MFU then counts the active parameters)")
    p.add_argument("--naive-samples", type=int, default=120)
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--window", type=int, default=0, metavar="ROWS",
                   help="the rows of every k-th batch of one sort window of this many rows (20000: the "
                        "worker's), so batches pad as a real shard's do; default: --samples rows sorted alone")
    p.add_argument("--disk", default=os.environ.get("BENCH_DISK", "/tmp"))
    p.add_argument("--skip-shm", action="store_true")
    p.add_argument("--skip-naive", action="store_true")
    p.add_argument("--pads", default="8", help="comma list of batch-width pad multiples to run ours with")
    p.add_argument("--compile", choices=("off", "on", "both", "regions", "layers"), default="both",
                   help="run ours eager, with compiled decoder layers, or both (compiled on disk and tmpfs); "
                        "regions: the non-fla modules of a hybrid's layers compiled (worker.model.compile_regions, "
                        "the worker's hybrid path); layers: a hybrid's whole layers compiled around its "
                        "linear-attention blocks (compile_hybrid_layers; measured, not kept: docs/benchmarks.md)")
    p.add_argument("--split-projections", action="store_true",
                   help="hybrid: q, k and v projected and convolved apart (worker.gdn, the worker's path), "
                        "before the tuning, after checking it against the layer's own forward")
    p.add_argument("--passes", type=int, default=1,
                   help="timed passes over the samples in one process (the first is a shard's first pass, "
                        "later ones the steady state)")
    p.add_argument("--quick-tuning", action="store_true",
                   help="the warm-up (--warm) times Triton's autotuning candidates briefly "
                        "(worker.tuning.quick_tuning, as the worker's load does)")
    p.add_argument("--worker-tuning", action="store_true",
                   help="before anything else runs fla's kernels: tune them once, at the run's own main batch "
                        "shape, on one linear-attention block, and warm every batch shape of the run; other "
                        "sizes take the tuned winner (worker.tuning, what the worker's load does)")
    p.add_argument("--track-tuning", action="store_true",
                   help="log every Triton autotuning (kernel, key, seconds) and when it happened")
    p.add_argument("--fused-swiglu", action="store_true",
                   help="the MLPs' gate, up and SiLU·mul as one Triton kernel (bench/swiglu.py's probe; slower)")
    p.add_argument("--skip-disk-probe", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on the CPU: checks the script runs")
    p.add_argument("--bucket-rows", action="store_true", help="batch row counts from buckets (the worker's "
                                                              "default for hybrid models on a GPU)")
    p.add_argument("--warm", action="store_true", help="before timing, one small batch per row bucket, as "
                                                       "the worker's load does for hybrid models")
    p.add_argument("--fla-conv", action="store_true",
                   help="hybrid without causal-conv1d: run the short convolution on fla's Triton kernel "
                        "(worker.model.use_fla_conv), after checking it against transformers' own")
    p.add_argument("--fla-norms", action="store_true",
                   help="hybrid: run the RMS norms on fla's fused kernels (worker.model.use_fla_norms), "
                        "after comparing the model's hidden states with its own norms'")
    p.add_argument("--profile-pass", action="store_true",
                   help="after the timed passes, one more under the profiler: the GPU's busy share of a real "
                        "pass, its idle gaps, kernel time by family (with --profile, the forward's too)")
    p.add_argument("--profile-long", action="store_true", help="with --profile: also 2 x 8,192-token forwards")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N forward passes of 16 x 1024 tokens (after a warm-up; a dense model's layers "
                        "compiled with --compile on/both) and report the GPU kernels by time, then exit")
    p.add_argument("--skip-warmup-pass", action="store_true",
                   help="time the first pass itself (no untimed warm-up pass): a shard's first minutes")
    args = p.parse_args()
    global DEVICE
    if args.cpu_smoke:
        DEVICE = "cpu"

    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    peak = matmul_peak() if DEVICE == "cuda" else 1e12
    vocab = 32000
    config = make_config(args.shape, vocab, tiny=args.cpu_smoke)
    t0 = time.perf_counter()
    with torch.device(DEVICE):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    init_s = time.perf_counter() - t0
    base = lm.model
    from worker.model import active_parameters
    params = active_parameters(base)[1]          # an MoE: the k of E experts a token meets
    plan = resolve_layers("speculators", config.num_hidden_layers)
    pad = int(args.pads.split(",")[0])
    samples = make_samples(args.samples, vocab, 1, args.max_len, args.window, args.budget, pad)
    rows = {"samples": len(samples), "window": args.window or None, "padding": round(padding_share(
        make_batches(samples, args.budget, pad, args.bucket_rows), pad), 4)}
    naive_samples = make_samples(args.naive_samples, vocab, 2, args.max_len)
    warm = make_samples(40, vocab, 3, args.max_len)
    result = {"shape": args.shape, "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu",
              "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "peak_tflops": round(peak / 1e12, 1),
              "nonembedding_params": params, "model_init_s": round(init_s, 1),
              "mean_tokens": round(sum(s.length for s in samples) / len(samples), 1), "rows": rows}
    fla = __import__("importlib.util").util.find_spec("fla") is not None
    result["fla"] = fla
    if args.fla_conv:
        result["fla_conv"] = check_fla_conv(base)
    if args.fla_norms:
        result["fla_norms"] = check_fla_norms(base, vocab)
    tuning: list = []
    if args.track_tuning:
        track_tuning(tuning)
        result["tuning"] = tuning
    if args.split_projections:      # before the tuning, as the worker's Tuner does (fla tunes at the first shape)
        from worker.gdn import use_split_projections
        result["split_projections"] = {"took": use_split_projections(linear_attention_layers(base))}
    if args.worker_tuning:                                # what the worker's load does (worker.tuning)
        from worker.tuning import STATS, batch_shapes, install, run_block
        install()
        t1 = time.perf_counter()
        shapes = batch_shapes([s.length for s in samples], args.budget, int(args.pads.split(",")[0]),
                              args.bucket_rows)
        block = linear_attention_layers(base)[0]
        run_block(block, shapes, torch.device(DEVICE))
        result["worker_tuning"] = {"seconds": round(time.perf_counter() - t1, 1), "shapes": len(shapes),
                                   "main_shape": list(shapes[0]) if shapes else None, **STATS}
    if args.split_projections:                            # checked after the tuning, as the worker's load does
        from worker.gdn import disagreement
        result["split_projections"]["rel_err_vs_own"] = disagreement(linear_attention_layers(base)[0])
    result["ref_rel_err"] = reference_error(lm, base, warm, plan)
    if args.fused_swiglu:                                 # before compiling: traced as one op in a layer
        from bench.swiglu import fuse_mlps
        result["fused_swiglu"] = fuse_mlps(base)
        result["ref_rel_err_fused"] = reference_error(lm, base, warm, plan, aside=True)

    if args.compile in ("regions", "layers"):
        from worker.model import compile_regions
        t1 = time.perf_counter()
        result["regions"] = (compile_regions if args.compile == "regions" else compile_hybrid_layers)(base)
        with torch.inference_mode():                      # what the worker's load does
            for rows, width in ((2, 128), (1, 64)):
                base(input_ids=torch.zeros((rows, width), dtype=torch.long, device=DEVICE), use_cache=False)
        sync()
        result["compile_s"] = round(time.perf_counter() - t1, 1)
        result["ref_rel_err_regions"] = reference_error(lm, base, warm, plan)
    if args.profile:
        if args.shape in ("dense", "moe30b") and args.compile in ("on", "both"):    # the worker's path
            compile_layers(base)
        result["profile"] = profile_forward(base, args.profile, vocab)
        if args.profile_long:                             # the longest rows' batches: 2 x 8,192
            result["profile_long"] = profile_forward(base, args.profile, vocab, rows=2, width=8192)
        result["conv_source"] = conv_source(base)
        if not args.profile_pass:
            print(json.dumps(result, indent=1))
            if args.json:
                json.dump(result, open(args.json, "w"), indent=1)
            return

    def scratch(root):
        d = tempfile.mkdtemp(dir=root, prefix="fleet-bench-")
        return d

    if not args.skip_naive:
        d = scratch(args.disk)
        naive(lm, warm[:5], plan, d)                      # warm-up
        result["naive"] = rate(naive(lm, naive_samples, plan, d), params, peak)
        shutil.rmtree(d)
    pads = [int(x) for x in args.pads.split(",")]
    targets = []
    if args.compile in ("off", "both", "regions", "layers"):
        targets += [((f"{args.compile}_disk" if args.compile in ("regions", "layers") else "ours_disk") + (f"_{i}_pad{pad}" if len(pads) > 1 else ""), args.disk, pad, False)
                    for i, pad in enumerate(pads)]
        targets += [] if args.skip_shm or args.compile == "both" else [("ours_tmpfs", "/dev/shm", pads[0], False)]
    if args.compile in ("on", "both"):
        targets += [("compiled_disk", args.disk, pads[0], True)]
        targets += [] if args.skip_shm else [("compiled_tmpfs", "/dev/shm", pads[0], True)]
    for name, root, pad, compiled in targets:
        if compiled and "compile_s" not in result:
            compile_layers(base)
            sync()
            t1 = time.perf_counter()
            with torch.inference_mode():                  # what the worker's load does
                for rows, width in ((2, 2 * pad), (1, pad)):
                    base(input_ids=torch.zeros((rows, width), dtype=torch.long, device=DEVICE), use_cache=False)
            sync()
            result["compile_s"] = round(time.perf_counter() - t1, 1)
        elif not compiled and args.compile not in ("regions", "layers"):
            uncompile_layers(base)
        d = scratch(root)
        if args.warm and "warm_s" not in result:
            from worker.extract import row_buckets, warm_rows
            buckets = row_buckets(args.budget, pad)
            steps = []
            from worker.tuning import quick_tuning
            with quick_tuning() if args.quick_tuning else contextlib.nullcontext():
                result["warm_s"] = round(warm_rows(base, torch.device(DEVICE), [(r, max(pad, 8)) for r in buckets],
                                                   lambda i: steps.append(time.perf_counter())), 1)
            result["warm_buckets"] = len(buckets)
            result["warm_step_s"] = {buckets[i]: round(b - a, 2) for i, (a, b) in
                                     enumerate(zip(steps, steps[1:] + [time.perf_counter()]))}
            result["tuned_at_warm"] = len(tuning)
        if not args.skip_warmup_pass:
            ours(base, warm, plan, d, args.budget, pad, bucket_rows=args.bucket_rows)  # allocator, cuBLAS, Triton
        for k in range(args.passes):
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            before = len(tuning)
            r = ours(base, samples, plan, d, args.budget, pad, bucket_rows=args.bucket_rows)
            if DEVICE == "cuda":
                r["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            r["tunings"] = len(tuning) - before
            result[name + (f"_pass{k + 1}" if k else "")] = rate(r, params, peak)
            print(json.dumps({name + f"_pass{k + 1}": result[name + (f"_pass{k + 1}" if k else "")]}), flush=True)
            if args.json:                                  # kept if a later step dies
                json.dump(result, open(args.json, "w"), indent=2)
            shutil.rmtree(d)
            d = scratch(root)
        if args.profile_pass:                             # once more, under the profiler
            result["profiled_" + name] = profile_pass(base, samples, plan, d, args.budget, pad, args.bucket_rows)
            print(json.dumps({"profiled_" + name: {k: v for k, v in result["profiled_" + name].items()
                                                   if k != "top"}}), flush=True)
        shutil.rmtree(d)
    import resource
    result["host_peak_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    result["weights_gib"] = round(sum(p.numel() * p.element_size() for p in lm.parameters()) / 2**30, 2)
    if not args.skip_disk_probe:
        sample_bytes = int(result["mean_tokens"] * len(plan.ids) * config.hidden_size * 2)
        for name, root in (("disk", args.disk), ("tmpfs", "/dev/shm")):
            result[f"{name}_write_mb_s"] = round(disk_bandwidth(root, sample_bytes, 4 << 30) / 1e6)
        best = max(result[t[0]]["tokens_per_s"] for t in targets)
        result["needed_mb_s_at_best"] = round(best * len(plan.ids) * config.hidden_size * 2 / 1e6)
    n = result["naive"]["tokens_per_s"] if "naive" in result else None
    print(json.dumps(result))
    print(f"\n{args.shape} on {result['gpu']} (peak {result['peak_tflops']} TFLOP/s, "
          f"{params / 1e9:.2f}B non-embedding params, fla={fla}, ref err {result['ref_rel_err']:.2e})")
    print(f"{'approach':<16}{'tokens/s':>10}{'samples/s':>11}{'MFU':>7}{'x naive':>9}{'first 60s':>11}")
    for name in (["naive"] if n else []) + [k for t in targets for k in result if k.startswith(t[0])]:
        r = result[name]
        print(f"{name:<16}{r['tokens_per_s']:>10}{r['samples_per_s']:>11}{r['mfu']:>7.1%}"
              + (f"{r['tokens_per_s'] / n:>9.2f}" if n else f"{'':>9}")
              + f"{r.get('first_s_tokens_per_s', '-'):>11}")
    if "compile_s" in result:
        print(f"compile at load: {result['compile_s']} s")
    if "disk_write_mb_s" in result:
        print(f"raw write MB/s: disk {result['disk_write_mb_s']}, tmpfs {result['tmpfs_write_mb_s']}; "
              f"needed at the best rate: {result['needed_mb_s_at_best']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
