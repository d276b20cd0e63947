"""fp8 hidden states: float8_e4m3fn values with one float32 scale per token per layer.

A stored sample holds `hidden_states` float8_e4m3fn [T, n, H] and `hidden_states_scales` float32
[T, n, 1]; the states are `hidden_states.to(bf16) * hidden_states_scales.to(bf16)`, which is
exactly what speculators' reader (`hs_connectors.transfer.FP8Transfer`, 0.9) computes: it
broadcasts whatever scale shape the file holds. speculators' own writer
(`hs_connectors.fp8_utils.quantize_tensor_to_fp8`) keeps one scale per token across all layers
([T, 1, 1]); the raw last layer of real models carries outlier channels hundreds of times larger
than the early layers, so a scale shared with it pushes the early layers into fp8's subnormal
range. One scale per token per layer costs 4 bytes per layer per token (0.1% at H = 4096) and
keeps every layer at fp8's full relative precision (3 mantissa bits: at most 2^-4 relative error
on each element above the subnormal range).

The scale of a row is a power of two: the smallest that brings the row's amax (fp32) to at most
464, the largest value fp8's round-to-nearest takes to its maximum 448 (so the largest element is
never cut by more than fp8's own rounding; amax / scale lies in (232, 464]). Powers of two make:
- dividing by the scale exact in bf16 as in fp32: quantising from bf16 needs no fp32 copy of the
  batch, and gives the same bits as quantising its fp32 widening;
- dequantising exact in bf16 (an fp8 value times a power of two), so our loader, speculators'
  FP8Transfer and an fp32 reader all get the same tensor, and re-quantising what was dequantised
  gives back the same bytes (export keeps fp8 files bit for bit);
- at most one binade of fp8's range unused, which only matters for elements 2^14 times smaller
  than their row's largest.
A row of zeros gets scale 1 and stays zeros. Torch only.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0                     # torch.finfo(torch.float8_e4m3fn).max
ROUNDS_TO_MAX = 464.0               # the midpoint between 448 and the next e4m3 step (480)
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY: what FP8Transfer looks for
SCALE_LAYOUT = "per-token-per-layer"
MIN_EXP, MAX_EXP = -126, 126        # scales stay normal floats in fp32 and bf16

# The stored dtype names: as fleet.toml / --dtype say them, and as torch names what a file holds.
TORCH_NAMES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn"}
DTYPES = tuple(TORCH_NAMES)


def dtype_of_name(name: str | None) -> str:
    """'bf16' or 'fp8' from either spelling (None, from a file or meta.json older than fp8: bf16)."""
    if name in (None, "", "bf16", "bfloat16"):
        return "bf16"
    if name in ("fp8", "float8_e4m3fn"):
        return "fp8"
    raise ValueError(f"unknown hidden-state dtype {name!r}")


def pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax / s <= 464, float32; 1 where amax is 0 or not finite.

    Stable under a round trip: a dequantised row's amax is (its fp8 maximum, in [240, 448]) * s,
    which gives s again."""
    amax = amax.float()
    mantissa, exp = torch.frexp(amax / ROUNDS_TO_MAX)     # amax / 464 = m * 2^e, m in [0.5, 1)
    exp = exp - (mantissa == 0.5).to(exp.dtype)           # an exact power of two needs no rounding up
    biased = (exp.clamp(MIN_EXP, MAX_EXP).to(torch.int32) + 127) << 23
    scale = biased.view(torch.float32)                     # 2^exp, built from its bits: exact everywhere
    return torch.where((amax > 0) & torch.isfinite(amax), scale, torch.ones_like(amax))


def quantize(hidden: torch.Tensor, per_layer: bool = True, inplace: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 values, float32 scales) of hidden [..., n, H] in any float dtype.

    per_layer: one scale per token per layer ([..., n, 1]); else one per token across the
    layers ([..., 1, 1], speculators' writer's layout, with our power-of-two rule).
    inplace: `hidden` is scaled in place (it must be a tensor the caller is done with) so no
    temporary of its size is made; the result is the same."""
    dims = (-1,) if per_layer else (-2, -1)
    # The largest |x| of bf16 values is a bf16 value: taken in the input's dtype (no fp32 copy of
    # the batch) and then widened, it is the fp32 amax exactly.
    amax = torch.linalg.vector_norm(hidden, float("inf"), dim=dims, keepdim=True)
    scales = pow2_scales(amax.float())
    inverse = (1.0 / scales).to(hidden.dtype)             # a power of two: exact in bf16
    scaled = hidden.mul_(inverse) if inplace else hidden * inverse
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8), scales


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """hs_connectors' own formula (`fp8.to(dtype) * scale.to(dtype)`), so any file it reads gives
    the same tensor here; exact for our power-of-two scales."""
    return values.to(dtype) * scales.to(dtype)


def speculators_quantize(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' writer, as hs_connectors 0.9 `fp8_utils.quantize_tensor_to_fp8` does it (one
    fp32 scale amax/448 per token over every layer, not rounded): the baseline the benchmark and
    the tests compare with. tests/worker/test_fp8.py checks it against the real function."""
    fp32 = hidden.float()
    amax = fp32.abs().amax(dim=tuple(range(1, fp32.dim())), keepdim=True)
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    return (fp32 / scale).to(FP8), scale
