"""fp8 hidden states against bf16 on one GPU: precision per layer, bytes per token, throughput of the
real extraction path.

Model: a random-initialised dense qwen3 of real shape (36 layers, hidden 4096, as bench/extract.py),
bf16, speculators' layers [2, 18, 33, 36] with hs[36] pre-norm (the raw last layer). Random weights
give every layer much the same magnitude, which real models do not have: their raw last layer
carries a few outlier channels (the "massive activations" of Sun et al., 2024, and the outlier
features of LLM.int8()) hundreds to thousands of times larger than the typical value, on every
token, written by the last layers' MLPs, while early layers stay at embedding scale. So before
measuring, the script injects them the way real models produce them: 4 channels (fixed seed) of
the last decoder layer's `mlp.down_proj` output rows are multiplied by a factor calibrated on a
few samples so that those channels' mean |value| in hs[L] is `--outlier-ratio` (default 1000)
times the median |value| of hs[L]. The achieved ratio is measured afterwards and reported.

Measured, in one process:
- throughput: worker.extract.run_extraction (the path `python -m worker.extract` runs: sorted
  batches, hooks, quantisation on the GPU for fp8, side-stream copy to pinned buffers, background
  writer, atomic files) over the same ShareGPT-like samples (lognormal, mean 728 tokens), bf16
  then fp8 then bf16 then fp8 (after a warm-up of each), files on `--disk`; tokens/s, bytes per
  token as written (file sizes / tokens), the writer's wait, its pinned host memory;
- precision, from the files themselves: the first `--precision-samples` samples of the bf16 pass
  are the reference; per layer, the relative error (Frobenius) and the minimum per-token cosine
  of (a) our fp8 files as `worker.formats.load_sample` dequantises them (one scale per token per
  layer) and (b) speculators' own writer's quantisation of the same bf16 states (one scale per
  token across the layers: `hs_connectors.fp8_utils.quantize_tensor_to_fp8`, as copied in
  worker.fp8.speculators_quantize), dequantised as its FP8Transfer does; and whether each fp8 file
  is exactly the quantisation of its bf16 twin.

Prints the JSON, then a short table last; writes the JSON to `--json`.

    python bench/fp8.py --json fp8.json                 # one GPU: well inside 5 minutes on an H200
    python bench/fp8.py --cpu-smoke --json smoke.json   # a tiny model on the CPU (the test suite runs it)
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

import numpy as np
import torch

from bench.extract import make_config
from worker import fp8
from worker.data import Sample
from worker.demo import sharegpt_lengths
from worker.events import EventLog
from worker.extract import Options, run_extraction
from worker.formats import load_sample, payload_bytes
from worker.layers import resolve_layers
from worker.model import Capture, find_decoder
from worker.writer import Stats

OUTLIER_CHANNELS = 4


class QuietLog(EventLog):
    """The worker's events, not printed: the benchmark prints its own figures."""

    def __init__(self):
        super().__init__(None, 0)

    def emit(self, event):
        return event


def tiny_config(vocab: int):
    from transformers import AutoConfig
    return AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False)


def make_samples(n: int, vocab: int, seed: int, max_len: int, mean: float) -> list[Sample]:
    """ShareGPT-like lengths (lognormal, as bench/extract.py), random token ids, all supervised."""
    import random
    out = []
    for i, length in enumerate(sharegpt_lengths(random.Random(seed), n, mean)):
        length = min(length, max_len)
        ids = np.random.default_rng(seed + i).integers(0, vocab, length, dtype=np.int64)
        out.append(Sample(i, ids, np.ones(length, dtype=np.uint8)))
    return out


def batch_ids(samples, device) -> torch.Tensor:
    width = max(s.length for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, : s.length] = torch.from_numpy(s.input_ids)
    return ids.to(device)


class Outliers:
    """Outlier channels in the raw last layer, as real models have them: OUTLIER_CHANNELS output
    rows of the last decoder layer's mlp.down_proj multiplied by a factor calibrated on a few
    samples so that those channels' mean |value| in hs[L] is `ratio` x the median |value| of hs[L]."""

    def __init__(self, base, samples, device):
        self.base, self.samples, self.device = base, samples, device
        self.decoder = find_decoder(base)
        self.L = len(self.decoder.layers)
        last = self.decoder.layers[self.L - 1]
        self.weight = last.mlp.down_proj.weight                       # [H, intermediate]
        H = self.weight.shape[0]
        self.channels = torch.randperm(H, generator=torch.Generator().manual_seed(7))[:OUTLIER_CHANNELS].tolist()
        self.rows = self.weight[self.channels].clone()                # the model as initialised
        mlp_out = {}
        hook = last.mlp.register_forward_hook(lambda m, a, out: mlp_out.__setitem__("t", out))
        self.typical, _, _ = self.measure()
        hook.remove()
        out = torch.cat([mlp_out["t"][r, : s.length] for r, s in enumerate(samples)])
        self.contribution = float(out[:, self.channels].float().abs().mean())

    def measure(self) -> tuple[float, float, float]:
        """Median |hs[L]|, mean |outlier channels of hs[L]|, median |hs[2]| (the first layer
        taken), over the samples' real tokens."""
        plan = resolve_layers(f"2,{self.L}", self.L, "pre")
        capture = Capture(self.decoder, plan)
        with torch.inference_mode():
            self.base(input_ids=batch_ids(self.samples, self.device), use_cache=False)
            hs = capture.take().float()                               # [B, S, 2, H]
        capture.remove()
        hs = torch.cat([hs[r, : s.length] for r, s in enumerate(self.samples)])     # [T, 2, H]
        last = hs[:, 1]
        return float(last.abs().median()), float(last[:, self.channels].abs().mean()), \
            float(hs[:, 0].abs().median())

    def set(self, ratio: float) -> dict:
        factor = ratio * self.typical / max(self.contribution, 1e-12)
        with torch.no_grad():
            self.weight[self.channels] = self.rows * factor
        typical, outlier, first = self.measure()
        return {"channels": self.channels, "down_proj_row_factor": round(factor, 2), "target_ratio": ratio,
                "achieved_ratio": round(outlier / typical, 1), "over_first_layer_median": round(outlier / first, 1),
                "hs_L_median_abs": typical, "hs_L_outlier_mean_abs": outlier, "hs_2_median_abs": first}


def capture_states(base, plan, samples, device) -> list[torch.Tensor]:
    """[T, n, H] bf16 per sample through the worker's own hooks (what it would write)."""
    capture = Capture(find_decoder(base), plan)
    out = []
    with torch.inference_mode():
        for s in samples:
            base(input_ids=torch.from_numpy(s.input_ids)[None].to(device), use_cache=False)
            out.append(capture.take()[0])
    capture.remove()
    return out


def sweep(base, plan, samples, outliers: Outliers, ratios: list[float], device) -> list[dict]:
    """Precision of both scale layouts at several outlier ratios, in memory (the files are exactly
    these quantisations: the precision section checks that on the real path)."""
    rows = []
    for ratio in ratios:
        made = outliers.set(ratio)
        ref = capture_states(base, plan, samples, device)
        ours = [fp8.dequantize(*fp8.quantize(r)) for r in ref]
        theirs = [fp8.dequantize(*fp8.speculators_quantize(r)) for r in ref]
        rows.append({"ratio": ratio, "achieved_ratio": made["achieved_ratio"],
                     "over_first_layer_median": made["over_first_layer_median"],
                     "per_token_per_layer": layer_metrics(ours, ref, device),
                     "per_token_speculators": layer_metrics(theirs, ref, device)})
    return rows


def extract(base, samples, plan, out_dir, device, budget, dtype, pad) -> dict:
    stats = Stats()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    run_extraction(base, [samples], plan, out_dir, 0, device,
                   Options(max_tokens_per_batch=budget, writer_queue=3, writer_threads=8, pad_multiple=pad,
                           dtype=dtype), QuietLog(), stats, progress_interval=1e9, total=len(samples))
    sync()
    seconds = time.perf_counter() - t0
    snap = stats.snapshot()
    return {"dtype": dtype, "seconds": round(seconds, 2), "tokens": snap["tokens"], "samples": snap["done"],
            "tokens_per_s": round(snap["tokens"] / seconds), "bytes": snap["bytes"],
            "bytes_per_token": round(snap["bytes"] / max(snap["tokens"], 1), 1),
            "writer_wait_s": snap["writer_wait_s"], "host_buffer_bytes": snap["host_buffer_bytes"]}


def layer_metrics(got: list[torch.Tensor], ref: list[torch.Tensor], device) -> list[dict]:
    """Per layer over all samples: relative error (Frobenius) and the minimum per-token cosine."""
    n = ref[0].shape[1]
    err2, norm2 = [0.0] * n, [0.0] * n
    mincos = [1.0] * n
    for g, r in zip(got, ref):
        g, r = g.to(device).float(), r.to(device).float()
        for l in range(n):
            err2[l] += float((g[:, l] - r[:, l]).pow(2).sum())
            norm2[l] += float(r[:, l].pow(2).sum())
            mincos[l] = min(mincos[l], float(torch.nn.functional.cosine_similarity(g[:, l], r[:, l], dim=-1).min()))
    return [{"rel_err": (err2[l] / norm2[l]) ** 0.5, "min_cos": mincos[l]} for l in range(n)]


def precision(bf16_dir: str, fp8_dir: str, indices: list[int], device) -> dict:
    ref, ours, per_token, same = [], [], [], 0
    for i in indices:
        r = load_sample(os.path.join(bf16_dir, f"hs_{i}.safetensors"))["hidden_states"]
        o = load_sample(os.path.join(fp8_dir, f"hs_{i}.safetensors"))["hidden_states"]
        values, scales = fp8.quantize(r.to(device))
        same += int(torch.equal(fp8.dequantize(values, scales).cpu(), o))
        ref.append(r)
        ours.append(o)
        per_token.append(fp8.dequantize(*fp8.speculators_quantize(r.to(device))).cpu())
    return {"samples": len(indices), "fp8_files_equal_quantised_bf16_files": same,
            "per_token_per_layer": layer_metrics(ours, ref, device),
            "per_token_speculators": layer_metrics(per_token, ref, device)}


def table(result: dict) -> str:
    ids = result["layer_ids"]
    o = result["outliers"]
    lines = [f"\nfp8 vs bf16: {result['model']} on {result['device_name']}; outlier channels in hs[{ids[-1]}] "
             f"at {o['achieved_ratio']}x its median ({o['over_first_layer_median']}x hs[{ids[0]}]'s)",
             f"{'layer':<8}{'per token per layer (ours)':>28}{'per token (speculators)':>26}",
             f"{'':<8}{'rel err':>14}{'min cos':>14}{'rel err':>13}{'min cos':>13}"]
    p = result["precision"]
    for k, a, b in zip(ids, p["per_token_per_layer"], p["per_token_speculators"]):
        lines.append(f"hs[{k}]".ljust(8) + f"{a['rel_err']:>14.4f}{a['min_cos']:>14.5f}"
                     f"{b['rel_err']:>13.4f}{b['min_cos']:>13.5f}")
    lines.append(f"\nworst of hs{ids[:-1]} (rel err / min cos) as the outliers grow:")
    lines.append(f"{'outliers':>10}{'x hs[' + str(ids[0]) + ']':>12}{'ours':>20}{'speculators':>22}")
    for row in result["sweep"]:
        worst = lambda m: (max(x["rel_err"] for x in m[:-1]), min(x["min_cos"] for x in m[:-1]))
        a, b = worst(row["per_token_per_layer"]), worst(row["per_token_speculators"])
        lines.append(f"{row['achieved_ratio']:>10,.0f}{row['over_first_layer_median']:>12,.0f}"
                     f"{a[0]:>11.4f} / {a[1]:.4f}{b[0]:>13.4f} / {b[1]:.4f}")
    lines.append(f"\n{'dtype':<7}{'tokens/s':>10}{'bytes/token':>13}{'writer wait':>13}{'host buffers':>14}")
    for dtype in ("bf16", "fp8"):
        r = result[dtype]
        lines.append(f"{dtype:<7}{r['tokens_per_s']:>10,}{r['bytes_per_token']:>13,.1f}{r['writer_wait_s']:>12.2f}s"
                     f"{r['host_buffer_bytes'] / 2**20:>10.1f} MiB")
    lines.append(f"fp8 / bf16: {result['fp8_over_bf16_tokens_per_s']:.3f}x tokens/s, "
                 f"{result['fp8_over_bf16_bytes_per_token']:.3f}x bytes per token")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU, a few samples")
    p.add_argument("--samples", type=int, default=None, help="samples per pass (default 800; smoke 24)")
    p.add_argument("--precision-samples", type=int, default=64)
    p.add_argument("--budget", type=int, default=16384, help="tokens per batch")
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--outlier-ratio", type=float, default=1000.0,
                   help="outlier channels' mean |value| / median |value| of the raw last layer")
    p.add_argument("--sweep", default="100,1000,10000,100000",
                   help="outlier ratios at which to compare the two scale layouts in memory")
    p.add_argument("--disk", default=os.environ.get("BENCH_DISK", tempfile.gettempdir()),
                   help="where the passes write (one bf16 pass at a time: ~19 GB at the defaults)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from transformers import AutoModel
    torch.manual_seed(0)
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke or not torch.cuda.is_available() else "cuda:0")
    if device.type != "cuda" and not smoke:
        p.error("no GPU: run with --cpu-smoke")
    vocab = 512 if smoke else 32000
    config = tiny_config(vocab) if smoke else make_config("dense", vocab)
    t0 = time.perf_counter()
    with torch.device(device):
        base = AutoModel.from_config(config, dtype=torch.bfloat16).eval()
    init_s = time.perf_counter() - t0
    L = config.num_hidden_layers
    plan = resolve_layers("speculators", L)
    n = args.samples or (24 if smoke else 800)
    mean = 40 if smoke else 728
    samples = make_samples(n, vocab, 1, args.max_len, mean)
    warm = make_samples(8 if smoke else 40, vocab, 3, args.max_len, mean)
    outlier_model = Outliers(base, warm[:4], device)
    outliers = outlier_model.set(args.outlier_ratio)
    pad = 1 if smoke else 8
    budget = 512 if smoke else args.budget
    result = {"model": f"dense qwen3, {L} layers, H={config.hidden_size}, random weights, bf16",
              "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "CPU",
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "model_init_s": round(init_s, 1), "layer_ids": list(plan.ids), "last_layer_norm": plan.last_layer_norm,
              "samples": n, "mean_tokens": round(sum(s.length for s in samples) / n, 1), "budget": budget,
              "disk": args.disk, "outliers": outliers}
    runs: dict[str, list[dict]] = {"bf16": [], "fp8": []}
    indices = [s.index for s in samples[: args.precision_samples]]
    root = tempfile.mkdtemp(dir=args.disk, prefix="fleet-fp8-bench-")
    try:
        for dtype in ("bf16", "fp8"):                                   # warm-up: allocator, kernels
            extract(base, warm, plan, os.path.join(root, f"warm-{dtype}"), device, budget, dtype, pad)
        for attempt, dtype in enumerate(("bf16", "fp8", "bf16", "fp8")):
            out = os.path.join(root, f"{dtype}-{attempt}")
            runs[dtype].append(extract(base, samples, plan, out, device, budget, dtype, pad))
            if attempt == 0:        # keep the precision samples' bf16 files only (bounds the disk used)
                for s in samples[len(indices):]:
                    os.unlink(os.path.join(out, f"hs_{s.index}.safetensors"))
            elif attempt == 1:
                result["precision"] = precision(os.path.join(root, "bf16-0"), out, indices, device)
                shutil.rmtree(os.path.join(root, "bf16-0"))
                shutil.rmtree(out)
            else:
                shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = [float(x) for x in args.sweep.split(",") if x]
    result["sweep"] = sweep(base, plan, samples[: min(16, args.precision_samples)], outlier_model, ratios, device)
    for dtype, passes in runs.items():
        best = dict(passes[0])
        best["tokens_per_s"] = round(sum(r["tokens_per_s"] for r in passes) / len(passes))
        best["passes_tokens_per_s"] = [r["tokens_per_s"] for r in passes]
        best["writer_wait_s"] = max(r["writer_wait_s"] for r in passes)
        result[dtype] = best
    result["fp8_over_bf16_tokens_per_s"] = round(result["fp8"]["tokens_per_s"] / result["bf16"]["tokens_per_s"], 3)
    result["fp8_over_bf16_bytes_per_token"] = round(result["fp8"]["bytes_per_token"] / result["bf16"]["bytes_per_token"], 3)
    result["payload_bytes_per_token"] = {d: payload_bytes(1, len(plan.ids), config.hidden_size, d)
                                         for d in ("bf16", "fp8")}
    if device.type == "cuda":
        result["gpu_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(table(result))


if __name__ == "__main__":
    main()
