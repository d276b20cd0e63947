"""What each saved layer of each sample holds, in four numbers, and what is wrong with them (issue 36).

A drafter trained on all-zero or mixed-up hidden states "converges" and is worthless a day later
(vLLM wrote zeros for hybrids for weeks; speculators mixed rows with batch > 1). So every sample's
manifest record carries, per saved layer, the statistics of the values as stored:

    [rms, max |x|, fraction of exact zeros, fingerprint]

the fingerprint being the mean over tokens of x . r, r a fixed random unit vector: identical states
give identical fingerprints, different ones almost never do. They are computed on the GPU as the
writer takes the batch (a few reductions per layer, no host sync: `batch_stats`), and from a file
on the CPU by the same formulas (`file_stats`), so `verify` finds a file changed after it was
written (`changed`), and over the whole run the layers no real model makes (`anomalies`): all
zero, constant, the same as another layer of the sample, the same as another sample with other
tokens, or an RMS far outside the run's own for that layer.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

FINGERPRINT_SEED = 20261206
ROBUST_Z = 12.0             # |log rms - median| over 1.4826 MAD beyond this...
OUTLIER_FACTOR = 10.0       # ...and a factor of this from the run's median: an outlier (a real layer's
                            # RMS varies by a small factor over rows; a lost scale or a zeroed stage
                            # moves it by orders of magnitude, and a tight run's MAD alone would
                            # flag a one-token row)
MIN_FOR_OUTLIERS = 20       # samples of a layer before outliers are judged
_probes: dict[tuple[int, str], torch.Tensor] = {}


def probe(hidden: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed random unit vector of the fingerprint, float32 [hidden], the same everywhere."""
    key = (hidden, str(device))
    if key not in _probes:
        g = torch.Generator().manual_seed(FINGERPRINT_SEED)
        r = torch.randn(hidden, generator=g, dtype=torch.float64)
        _probes[key] = (r / r.norm()).float().to(device)
    return _probes[key]


def batch_stats(hidden: torch.Tensor, lengths: torch.Tensor, scales: torch.Tensor | None = None) -> torch.Tensor:
    """[B, n, 4] float32 on hidden's device: each row's statistics per layer slot over its first
    lengths[b] tokens, of the values as stored (fp8: `hidden` the fp8 values and `scales` [B, S, n, 1]
    their float32 scales). One layer slot at a time, so no temporary is larger than [B, S, H]."""
    B, S, n, H = hidden.shape
    device = hidden.device
    valid = (torch.arange(S, device=device)[None, :] < lengths.to(device)[:, None]).float()   # [B, S]
    tokens = valid.sum(1).clamp(min=1)                                                       # [B]
    r = probe(H, device)
    out = torch.empty(B, n, 4, dtype=torch.float32, device=device)
    for j in range(n):
        x = hidden[:, :, j]
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):     # fp8: its bits say zero
            zeros = ((x.view(torch.uint8) & 0x7F) == 0).sum(-1).float()
            x = x.to(torch.bfloat16)
        else:
            zeros = (x == 0).sum(-1).float()
        scale = scales[:, :, j, 0].float() if scales is not None else 1.0
        sq = torch.linalg.vector_norm(x, 2, dim=-1, dtype=torch.float32).square() * scale * scale   # [B, S]
        mx = torch.linalg.vector_norm(x, float("inf"), dim=-1).float() * scale
        fp = (x.float() @ r) * scale if x.dtype == torch.float32 else (x @ r.to(x.dtype)).float() * scale
        out[:, j, 0] = ((sq * valid).sum(1) / (tokens * H)).sqrt()
        out[:, j, 1] = (mx * valid).amax(1)
        out[:, j, 2] = (zeros * valid).sum(1) / (tokens * H)
        out[:, j, 3] = (fp * valid).sum(1) / tokens
    return out


def file_stats(hidden: torch.Tensor | None, values: torch.Tensor | None = None,
               scales: torch.Tensor | None = None) -> list:
    """One sample's statistics, [n][4], from what its file holds: `hidden` [T, n, H] as read (bf16),
    or for fp8 its stored `values` and `scales` ([T, n, 1]) — the formulas of batch_stats."""
    if values is not None:
        assert scales is not None, "fp8 values are read with their scales"
        stats = batch_stats(values[None], torch.tensor([values.shape[0]]), scales[None])
    else:
        assert hidden is not None, "a bf16 file's states are read"
        stats = batch_stats(hidden[None], torch.tensor([hidden.shape[0]]))
    return rounded(stats[0])


def stats_of_file(layout, tensors: dict) -> list:
    """A file's statistics as its writer took them: from the stored fp8 values and scales where the
    layout keeps them, else from its states as read."""
    from .fp8 import SCALES_KEY
    if layout.format == "speculators" and SCALES_KEY in tensors:
        return file_stats(None, tensors["hidden_states"], tensors[SCALES_KEY])
    hidden, _, _ = layout.unpack(tensors)
    return file_stats(hidden)


def rounded(stats: torch.Tensor) -> list:
    """[n, 4] as the manifest keeps it: six significant digits (JSON stays small)."""
    return [[float(f"{v:.6g}") for v in row] for row in stats.tolist()]


def changed(recorded: list, found: list, layer_ids: list[int]) -> str | None:
    """How a file's statistics now differ from those recorded when it was written (None: alike,
    within the rounding and the CPU's other summation order)."""
    for k, (a, b) in enumerate(zip(recorded, found)):
        rms = max(abs(a[0]), abs(b[0]), 1e-12)
        if abs(a[0] - b[0]) > 1e-3 * rms or abs(a[1] - b[1]) > 1e-3 * max(abs(a[1]), 1e-12) or \
                abs(a[2] - b[2]) > 1e-4 or abs(a[3] - b[3]) > 1e-3 * rms:
            return (f"layer {layer_name(layer_ids, k)} holds other values than were written "
                    f"(rms {b[0]:.4g}, written {a[0]:.4g}; fingerprint {b[3]:.4g}, written {a[3]:.4g})")
    return None


def layer_name(layer_ids: list[int], slot: int) -> str:
    return str(layer_ids[slot]) if slot < len(layer_ids) else f"slot {slot}"


def anomalies(records: list[dict], layer_ids: list[int]) -> dict[int, str]:
    """index -> what no real model writes, over every written record with statistics: a layer all
    zero or constant, a layer the same as another of the sample, a sample the same as another
    with other tokens, a layer's RMS far outside the run's own (robust z-score over its log)."""
    out: dict[int, str] = {}
    seen: dict[tuple, tuple] = {}
    logs: dict[int, list[tuple[float, int]]] = defaultdict(list)
    for rec in records:
        stats, i = rec.get("stats"), rec["index"]
        if not isinstance(stats, list) or not stats:
            continue
        for k, (rms, mx, zeros, fp) in enumerate(stats):
            name = layer_name(layer_ids, k)
            if zeros >= 1.0 or rms == 0:
                out.setdefault(i, f"layer {name}: all zero")
            elif mx <= rms * (1 + 1e-4):
                out.setdefault(i, f"layer {name}: constant (max |x| {mx:.4g} = its rms)")
            else:
                logs[k].append((math.log(rms), i))
        twins = [(a, b) for a in range(len(stats)) for b in range(a + 1, len(stats))
                 if stats[a] == stats[b] and stats[a][0] > 0]
        if twins:
            a, b = twins[0]
            out.setdefault(i, f"layers {layer_name(layer_ids, a)} and {layer_name(layer_ids, b)} hold the same values")
        # the same statistics over as many tokens, from other tokens: another sample's states (a row
        # of one token repeated gives the same states at any length, so the length is part of it)
        key = (rec.get("tokens"), tuple(map(tuple, stats)))
        j, crc = seen.setdefault(key, (i, rec.get("ids_crc")))
        if j != i and crc != rec.get("ids_crc"):
            out.setdefault(i, f"the same states as sample {j}, whose tokens differ")
    for k, values in logs.items():
        if len(values) < MIN_FOR_OUTLIERS:
            continue
        xs = sorted(v for v, _ in values)
        median = xs[len(xs) // 2]
        mad = sorted(abs(v - median) for v in xs)[len(xs) // 2] * 1.4826
        if mad <= 0:
            continue
        for v, i in values:
            z = abs(v - median) / mad
            if z > ROBUST_Z and abs(v - median) > math.log(OUTLIER_FACTOR):
                out.setdefault(i, f"layer {layer_name(layer_ids, k)}: rms {math.exp(v):.4g}, the run's is "
                                  f"{math.exp(median):.4g} (robust z {z:.0f})")
    return out
