"""A Gated DeltaNet layer (Qwen3.5's linear attention) with its query, key and value projected
apart: the same arithmetic as the layer's own forward, without the three copies it costs.

The layer's own forward projects q, k and v with one GEMM, convolves the result as one tensor and
splits it: q, k and v are then strided views of one buffer; transformers (5.17) repeats q and k
to the value heads and fla makes v contiguous: three copies a layer, 3.1% of the 27B hybrid's
forward on an H100, and fla's l2 norm three times slower on the strided input (docs/benchmarks.md,
round 12). The convolution is depthwise (one filter per channel), so convolving q, k and v apart
is the same operation; projecting them with three GEMMs over row slices of the one weight is the
same too. Each then comes out contiguous, and fla takes q and k at their own heads (value head i
reads key head i // (value heads / key heads), as the repeat gives it).

`split_forward` is put in place of the layer's forward only where the layer has the parts it
reads (transformers' Qwen3.5 layout: `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) and,
at load, agrees with the layer's own forward on one random input (`disagreement`); a forward
with a cache, packed sequences or anything else it does not know runs the layer's own. It is
marked as the worker's (`_fleet_compiled`), so the reference checks (worker/reference.py) set
it aside and compare against transformers' own code.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Protocol, cast

import torch
import torch.nn.functional as F

# What split_forward reads from a layer; a layer without one of them keeps its own forward.
PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
         "out_proj", "key_dim", "value_dim", "head_k_dim", "head_v_dim", "activation")

# Relative error between split_forward and the layer's own on one random input, above which the
# layer keeps its own (the two run the same kernels on the same numbers: ~1e-3 in bf16 from the
# GEMMs' tiling, ~1e-7 in fp32).
AGREEMENT = 2e-2

# Set to 0, every layer keeps its own forward (a comparison, or a transformers this gets wrong).
SWITCH = "FLEET_SPLIT_PROJECTIONS"

# Keyword arguments whose presence means a forward split_forward does not run (a decoding cache,
# packed sequences).
OWN_FORWARD_KWARGS = ("cache_params", "past_key_values", "cu_seq_lens_q", "seq_idx")


class GatedDeltaNetParts(Protocol):
    """The parts split_forward reads (PARTS) as transformers' Qwen3.5 layer has them: the type
    checker's view of a layer that `splittable` passed (it checks each is there, conv1d a Conv1d)."""
    in_proj_qkv: torch.nn.Linear
    in_proj_z: torch.nn.Module
    in_proj_b: torch.nn.Module
    in_proj_a: torch.nn.Module
    conv1d: torch.nn.Conv1d
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    norm: torch.nn.Module
    out_proj: torch.nn.Module
    key_dim: int
    value_dim: int
    head_k_dim: int
    head_v_dim: int
    activation: str | None


def enabled() -> bool:
    return os.environ.get(SWITCH) != "0"


def splittable(layer: torch.nn.Module) -> bool:
    return all(hasattr(layer, p) for p in PARTS) and isinstance(layer.conv1d, torch.nn.Conv1d)


def torch_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
               ) -> torch.Tensor:
    """The causal depthwise convolution in [batch, time, channels] layout, as transformers' own
    reference computes it (conv over left padding, then the activation)."""
    t = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), weight.unsqueeze(1), bias, padding=weight.shape[-1] - 1,
                 groups=x.shape[-1])[..., :t]
    if activation is not None:
        y = getattr(F, activation)(y)
    return y.transpose(1, 2)


def fla_conv() -> Callable | None:
    """fla's causal convolution in [batch, time, channels] layout (contiguous in, contiguous out)."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:                            # absent, or an fla without it
        return None

    def conv(x, weight, bias, activation):
        y = causal_conv1d(x, weight, bias, activation=activation)
        return y[0] if isinstance(y, tuple) else y
    return conv


def fla_core() -> Callable | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    return chunk_gated_delta_rule


def kernels(layer: torch.nn.Module) -> tuple[Callable, Callable] | None:
    """(conv, core) for split_forward: fla's where the layer is on a GPU and fla is there;
    elsewhere the torch implementations of the layer's own module (what it runs without fla).
    None where the layer cannot be split (parts or kernels missing)."""
    if not splittable(layer):
        return None
    if next(layer.parameters()).device.type == "cuda":
        conv, core = fla_conv(), fla_core()
        return (conv, core) if conv and core else None
    home = sys.modules.get(type(layer).__module__)
    core = getattr(home, "torch_chunk_gated_delta_rule", None)
    return (torch_conv, core) if core else None


def split_forward(layer: torch.nn.Module, conv: Callable, core: Callable) -> Callable:
    """The layer's forward with q, k and v projected and convolved apart (see the module's doc)."""
    parts = cast(GatedDeltaNetParts, layer)      # one that `kernels` found splittable

    def own(*args, **kwargs):                    # looked up at the call: the class's forward now
        return type(layer).forward(layer, *args, **kwargs)
    kd, vd = parts.key_dim, parts.value_dim
    bounds = ((0, kd), (kd, 2 * kd), (2 * kd, 2 * kd + vd))

    def forward(hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None,
                **kwargs):
        if cache is not None or hidden_states.dim() != 3 or any(
                kwargs.get(k) is not None for k in OWN_FORWARD_KWARGS):
            return own(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        if attention_mask is not None:            # padding zeroed, as the layer's own does
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        rows, width, _ = hidden_states.shape
        weight, bias = parts.in_proj_qkv.weight, parts.in_proj_qkv.bias
        filters, shift = parts.conv1d.weight.squeeze(1), parts.conv1d.bias
        q, k, v = (conv(F.linear(hidden_states, weight[a:b], None if bias is None else bias[a:b]),
                        filters[a:b], None if shift is None else shift[a:b], parts.activation)
                   for a, b in bounds)
        q = q.reshape(rows, width, -1, parts.head_k_dim)
        k = k.reshape(rows, width, -1, parts.head_k_dim)
        v = v.reshape(rows, width, -1, parts.head_v_dim)
        z = parts.in_proj_z(hidden_states)
        beta = parts.in_proj_b(hidden_states).sigmoid()
        g = -parts.A_log.float().exp() * F.softplus(parts.in_proj_a(hidden_states).float() + parts.dt_bias)
        out, _ = core(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=True)
        out = parts.norm(out.reshape(-1, parts.head_v_dim), z.reshape(-1, parts.head_v_dim))
        return parts.out_proj(out.reshape(rows, width, -1))
    return forward


def linear_attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's Gated DeltaNet blocks (by class name: Qwen3.5's, Qwen3-Next's)."""
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


def disagreement(layer: torch.nn.Module, width: int = 64, seed: int = 0) -> float | None:
    """Relative error of split_forward against the layer's own forward on one random input of
    `width` tokens; None where the layer cannot be split (parts or kernels missing)."""
    found = kernels(layer)
    if found is None:
        return None
    param = next(layer.parameters())
    g = torch.Generator(device=param.device).manual_seed(seed)
    width_in = cast(GatedDeltaNetParts, layer).in_proj_qkv.in_features     # kernels found it splittable
    x = torch.randn((1, width, width_in), generator=g, device=param.device, dtype=param.dtype)
    with torch.inference_mode():
        own = type(layer).forward(layer, x).float()
        split = split_forward(layer, *found)(x).float()
    return float((split - own).norm() / own.norm().clamp_min(1e-30))


def use_split_projections(layers: list[torch.nn.Module]) -> int:
    """split_forward in place of each layer's own forward (those that can be split and keep their
    own now, unless FLEET_SPLIT_PROJECTIONS=0); how many took. Check `disagreement` on one first."""
    took = 0
    for layer in layers if enabled() else ():
        found = kernels(layer)
        if found is None or "forward" in layer.__dict__:
            continue
        layer.forward = split_forward(layer, *found)
        setattr(layer, "_fleet_compiled", True)   # the worker's: reference checks set it aside (a plain attribute)
        took += 1
    return took


def split_projections(model: torch.nn.Module) -> str:
    """split_forward on every Gated DeltaNet layer of `model` after checking it against the
    layer's own forward on the first; what was done, for the load's path line ('' where the model
    has no such layer or the kernels are missing)."""
    layers = [m for m in linear_attention_layers(model) if "forward" not in m.__dict__]
    if not layers:
        return ""
    if not enabled():
        return f", q/k/v projected together ({SWITCH}=0)"
    err = disagreement(layers[0])
    if err is None:
        return ""
    if not err <= AGREEMENT:
        return f", q/k/v projected together (projected apart they differ by {err:.1e})"
    n = use_split_projections(layers)
    return f", q/k/v projected apart in {n} linear-attention layers (no copies for fla)"
