"""Issue 26 dense, round 8 probe: rows packed into one sequence of a fixed length (no padding,
every GEMM at the same M) against the worker's padded batches — forward and capture only, in
one process, on one GPU.

    python3 bench/dense_packed.py --json packed.json

Parts: (1) the varlen attention kernels this torch has (flash's, cuDNN's ragged one, the public
varlen API), each checked against each row's own SDPA and timed on one real pack, beside the
padded cuDNN SDPA the worker runs now; (2) whole passes over the bench's 1,200 rows, padded
(make_batches, as the worker) and packed (first-fit bins of the budget), forward + capture +
finite check, no writes; (3) the packed capture against each row's own eager forward.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch
import torch.nn.functional as F

from bench.extract import make_config, make_samples, matmul_peak, sync
from worker.batching import make_batches, padded_length
from worker.layers import resolve_layers
from worker.model import Capture, compile_layers, find_decoder, unpacked_rows

DEV = "cuda"
KERNEL = {"name": None}


def cu_of(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)


def fa2(q, k, v, cu, mx, scale):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mx, mx, 0.0, True, False, scale=scale)[0]


def cudnn(q, k, v, cu, mx, scale):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, mx, mx, False, 0.0, True, False,
                                                   scale=scale)[0]


def api(q, k, v, cu, mx, scale):
    from torch.nn.attention.varlen import varlen_attn
    import inspect
    params = inspect.signature(varlen_attn).parameters
    if "is_causal" in params:
        return varlen_attn(q, k, v, cu, cu, mx, mx, is_causal=True, scale=scale)
    return varlen_attn(q, k, v, cu, cu, mx, mx, scale=scale, window_size=(-1, 0), enable_gqa=True)


KERNELS = {"fa2": fa2, "cudnn": cudnn, "api": api}


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: [1, H, T, D] in, [1, T, H, D] out; the rows' bounds
    come in as cu_seq_lens_q (flash-attention's kwargs, passed down by the model)."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = KERNELS[KERNEL["name"]](q, k, v, cu, kwargs["max_length_q"], scaling)
    return out.unsqueeze(0), None


def reference(q, k, v, lengths, scale):
    outs, start = [], 0
    for L in lengths:
        s = slice(start, start + L)
        o = F.scaled_dot_product_attention(q[s].transpose(0, 1)[None], k[s].transpose(0, 1)[None],
                                           v[s].transpose(0, 1)[None], is_causal=True, scale=scale,
                                           enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
        start += L
    return torch.cat(outs)


def timed(fn, n=20):
    fn()
    sync()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    sync()
    return s.elapsed_time(e) / n / 1e3


def probe_attention(lengths, hq=32, hk=8, d=128) -> dict:
    T = sum(lengths)
    q, k, v = (torch.randn(T, h, d, device=DEV, dtype=torch.bfloat16) for h in (hq, hk, hk))
    cu, mx, scale = cu_of(lengths), max(lengths), d ** -0.5
    ref = reference(q, k, v, lengths, scale).float()
    flops = sum(4 * hq * d * L * L / 2 for L in lengths)
    out = {"rows": len(lengths), "tokens": T, "max": mx}
    for name, fn in KERNELS.items():
        try:
            got = fn(q, k, v, cu, mx, scale).float()
            err = float((got - ref).norm() / ref.norm())
            sec = timed(lambda: fn(q, k, v, cu, mx, scale))
            out[name] = {"rel_err": err, "ms": round(sec * 1e3, 3), "tflops": round(flops / sec / 1e12, 1)}
        except Exception as e:                                  # noqa: BLE001 - a probe reports
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    W = padded_length(mx, 8)                                    # the worker's padded batch of these rows
    qp, kp, vp = (torch.randn(len(lengths), h, W, d, device=DEV, dtype=torch.bfloat16) for h in (hq, hk, hk))
    sec = timed(lambda: F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True))
    out["padded_sdpa"] = {"ms": round(sec * 1e3, 3), "tflops_real": round(flops / sec / 1e12, 1), "width": W}
    return out


def bins_of(samples, budget):
    """First-fit decreasing: each bin's lengths sum to at most the budget."""
    bins, room = [], []
    for s in sorted(samples, key=lambda s: -s.length):
        for i, r in enumerate(room):
            if s.length <= r:
                bins[i].append(s)
                room[i] -= s.length
                break
        else:
            bins.append([s])
            room.append(budget - s.length)
    return bins


def packed_inputs(batch, budget):
    lengths = [s.length for s in batch]
    T = max(budget, sum(lengths))
    tail = T - sum(lengths)
    ids = torch.empty(T, dtype=torch.long)
    pos = torch.empty(T, dtype=torch.long)
    start = 0
    for s in batch:
        ids[start:start + s.length] = torch.from_numpy(s.input_ids)
        pos[start:start + s.length] = torch.arange(s.length)
        start += s.length
    if tail:
        ids[start:] = int(batch[-1].input_ids[-1])
        pos[start:] = torch.arange(tail)
    segs = lengths + ([tail] if tail else [])
    return (ids[None].to(DEV, non_blocking=True), pos[None].to(DEV, non_blocking=True),
            cu_of(segs), max(segs))


def run_padded(base, capture, batches, pad) -> None:
    for batch in batches:
        W = padded_length(max(s.length for s in batch), pad)
        ids = torch.empty(len(batch), W, dtype=torch.long)
        for r, s in enumerate(batch):
            ids[r, :s.length] = torch.from_numpy(s.input_ids)
            ids[r, s.length:] = int(s.input_ids[-1])
        base(input_ids=ids.to(DEV, non_blocking=True), use_cache=False)
        hidden = capture.take()
        torch.isfinite(hidden).flatten(2).all(-1)


def run_packed(base, capture, bins, budget) -> None:
    for batch in bins:
        ids, pos, cu, mx = packed_inputs(batch, budget)
        base(input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
             max_length_q=mx, max_length_k=mx)
        hidden = capture.take()
        torch.isfinite(hidden).flatten(2).all(-1)


def one_pass(fn, tokens) -> dict:
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode(), unpacked_rows():
        fn()
    sync()
    sec = time.perf_counter() - t0
    return {"seconds": round(sec, 3), "tokens_per_s": round(tokens / sec)}


def check_packed(lm, base, capture, samples, budget) -> float:
    """Largest relative error of the packed capture against each row's own eager forward."""
    worst = 0.0
    with torch.inference_mode():
        ids, pos, cu, mx = packed_inputs(samples, budget)
        base(input_ids=ids, position_ids=pos, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
             max_length_q=mx, max_length_k=mx)
        got = capture.take()[0].float()
        start = 0
        for s in samples:
            base(input_ids=torch.from_numpy(s.input_ids)[None].to(DEV), use_cache=False)
            ref = capture.take()[0].float()
            g = got[start:start + s.length]
            worst = max(worst, float((g - ref).norm() / ref.norm()))
            start += s.length
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=1200)
    p.add_argument("--budget", type=int, default=16384)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--kernels", default="cudnn,fa2", help="packed passes with these varlen kernels")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from transformers import AttentionInterface, AutoModelForCausalLM
    AttentionInterface.register("fleet_packed", packed_attention)
    torch.manual_seed(0)
    result = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
              "transformers": __import__("transformers").__version__}

    def save():
        print(json.dumps(result, indent=1), flush=True)
        if args.json:
            json.dump(result, open(args.json, "w"), indent=1)
    result["peak_tflops"] = round(matmul_peak() / 1e12, 1)
    samples = make_samples(args.samples, 32000, 1, 8192)
    bins = bins_of(samples, args.budget)
    batches = make_batches(samples, args.budget, 8)
    tokens = sum(s.length for s in samples)
    result["bins"] = {"n": len(bins), "fill": round(tokens / sum(max(args.budget, sum(s.length for s in b))
                                                                    for b in bins), 4)}
    result["batches"] = {"n": len(batches), "fill": round(tokens / sum(
        len(b) * padded_length(max(s.length for s in b), 8) for b in batches), 4)}
    result["attention"] = [probe_attention([s.length for s in b]) for b in (bins[0], bins[len(bins) // 2], bins[-2])]
    save()

    config = make_config("dense", 32000)
    config._attn_implementation = "fleet_packed"
    with torch.device(DEV):
        lm = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    base = lm.model
    base.config._attn_implementation = "fleet_packed"
    params = sum(p.numel() for p in base.parameters()) - base.get_input_embeddings().weight.numel()
    plan = resolve_layers("speculators", config.num_hidden_layers)
    capture = Capture(find_decoder(base), plan)
    mfu = lambda r: round(2 * params * r["tokens_per_s"] / (result["peak_tflops"] * 1e12), 4)  # noqa: E731
    usable = [k for k in args.kernels.split(",") if "error" not in result["attention"][0].get(k, {"error": 1})]
    if usable:
        KERNEL["name"] = usable[0]
        result["check_eager_packed"] = check_packed(lm, base, capture, samples[:8], 8192)
    compile_layers(base)
    warm = make_samples(40, 32000, 3, 8192)
    with torch.inference_mode(), unpacked_rows():
        run_padded(base, capture, make_batches(warm, args.budget, 8), 8)
        for name in usable:
            KERNEL["name"] = name
            run_packed(base, capture, bins_of(warm, args.budget), args.budget)
    for k in range(args.passes):
        r = one_pass(lambda: run_padded(base, capture, batches, 8), tokens)
        result[f"padded_{k}"] = {**r, "mfu": mfu(r)}
        for name in usable:
            KERNEL["name"] = name
            r = one_pass(lambda: run_packed(base, capture, bins, args.budget), tokens)
            result[f"packed_{name}_{k}"] = {**r, "mfu": mfu(r)}
        save()
    if usable:
        KERNEL["name"] = usable[0]
        result["check_eager_packed_compiled"] = check_packed(lm, base, capture, samples[:8], 8192)
    save()


if __name__ == "__main__":
    main()
