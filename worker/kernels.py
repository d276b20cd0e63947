"""Optional fast kernels for GPU hosts (the `[fast]` extra), used where installed and where the GPU
runs them, today's path otherwise (issue 56).

What there is: a mixture-of-experts block's experts (the HF layout: `gate_up_proj` [E, 2I, H],
`down_proj` [E, H, I], SwiGLU) on quack's CuTe DSL grouped GEMMs (`quack-kernels`, compiled at
run time by `nvidia-cutlass-dsl`, no nvcc): the up projection reads each routed token's row
straight from the hidden states (a gather in the GEMM's A load, no [tokens x top-k, H] copy) and
writes silu(gate) x up from its epilogue (no [tokens x top-k, 2I] tensor), the down projection is
one grouped GEMM over the same groups, and the weighted sum over each token's experts runs in
torch as transformers' own `grouped_mm` path does it (the same order, deterministic).

Every swap is checked at load against the module's own forward on a probe input and kept only
where it agrees (`PROBE_TOLERANCE`, bf16's rounding); the reference checks set it aside
(`_fleet_compiled`: worker.reference.eager runs the module as transformers wrote it). `FLEET_FAST=0`
keeps today's path where the kernels are installed (an A/B in one run). The path line says what
runs (`use_fast_kernels`' note).

Measured in docs/benchmarks.md (issue 56): kept only where it wins.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Callable

import torch

FAST_ENV = "FLEET_FAST"
PROBE_TOLERANCE = 2e-2          # relative, bf16: grouped GEMMs accumulate in another order
PROBE_TOKENS = 512

GemmSwiglu = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
GemmPlain = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def wanted() -> bool:
    """False where FLEET_FAST=0 asks for today's path."""
    return os.environ.get(FAST_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def quack_missing(device: torch.device) -> str | None:
    """Why quack's GEMMs cannot run here (None: they can): the packages, a CUDA GPU of compute
    capability 9.x (Hopper) or 10.x (Blackwell), the kernels' two targets."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return "no CUDA GPU"
    for package, module in (("quack-kernels", "quack"), ("nvidia-cutlass-dsl", "cutlass")):
        if importlib.util.find_spec(module) is None:
            return f"{package} not installed"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in (9, 10):
        return f"compute capability {major}.{minor} (quack's GEMMs: 9.x and 10.x)"
    return None


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts blocks in transformers' fused layout that the grouped path can run: 3-D
    `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], gated, no bias, not transposed, SiLU."""
    found = []
    for module in model.modules():
        up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        if not (isinstance(up, torch.Tensor) and isinstance(down, torch.Tensor) and up.dim() == 3
                and down.dim() == 3):
            continue
        experts, two_i, hidden = up.shape
        if down.shape != (experts, hidden, two_i // 2) or two_i % 2:
            continue
        if getattr(module, "has_bias", False) or getattr(module, "is_transposed", False) \
                or not getattr(module, "has_gate", True):
            continue
        act = getattr(getattr(module, "config", None), "hidden_act", "silu")
        if str(act).lower() not in ("silu", "swish"):
            continue
        found.append(module)
    return found


def routed_groups(top_k_index: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs grouped by expert, without a host sync: `order` (each pair's
    place in the flattened [tokens x k] routing, sorted by expert, stable), `cu` (int32 [E + 1],
    each expert's first pair) and `rows` (int32: each sorted pair's token)."""
    flat = top_k_index.reshape(-1)
    _, order = torch.sort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    cu = torch.zeros(experts + 1, dtype=torch.int32, device=flat.device)
    cu[1:] = torch.cumsum(counts, 0)
    rows = torch.div(order, top_k_index.shape[-1], rounding_mode="floor").to(torch.int32)
    return order, cu, rows


def grouped_forward(gemm_swiglu: GemmSwiglu, gemm_plain: GemmPlain):
    """An experts block's forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) on
    two grouped GEMMs: `gemm_swiglu(hidden, gate_up_proj, cu, rows)` -> silu(gate) x up of each
    sorted pair [T k, I] (rows gathered from `hidden`), `gemm_plain(act, down_proj, cu)` -> [T k, H].
    The routing weights and the sum over each token's k experts as transformers'
    grouped_mm_experts_forward does them (bf16 product, then a sum over k)."""
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, hidden = hidden_states.shape
        k = top_k_index.shape[-1]
        order, cu, rows = routed_groups(top_k_index, self.gate_up_proj.shape[0])
        act = gemm_swiglu(hidden_states, self.gate_up_proj, cu, rows)
        out = gemm_plain(act, self.down_proj, cu)
        weighted = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return weighted[back].view(tokens, k, hidden).sum(dim=1).to(hidden_states.dtype)
    return forward


def torch_gemms() -> tuple[GemmSwiglu, GemmPlain]:
    """The two grouped GEMMs in plain torch, a loop over experts (CPU tests; the reference the
    kernels' index handling is held to)."""
    def swiglu(x, w, cu, rows):
        out = x.new_empty(rows.numel(), w.shape[1] // 2)
        bounds = cu.tolist()
        for e in range(w.shape[0]):
            a, b = bounds[e], bounds[e + 1]
            if b > a:
                gate, up = torch.nn.functional.linear(x[rows[a:b].long()], w[e]).chunk(2, dim=-1)
                out[a:b] = torch.nn.functional.silu(gate) * up
        return out

    def plain(x, w, cu):
        out = x.new_empty(x.shape[0], w.shape[1])
        bounds = cu.tolist()
        for e in range(w.shape[0]):
            a, b = bounds[e], bounds[e + 1]
            if b > a:
                out[a:b] = torch.nn.functional.linear(x[a:b], w[e])
        return out
    return swiglu, plain


def quack_gemms() -> tuple[GemmSwiglu, GemmPlain]:
    """The two grouped GEMMs on quack's CuTe DSL kernels: varlen in M (one group an expert),
    the up projection gathering its A rows (`A_idx`) with the SwiGLU in its epilogue, the [gate;
    up] halves of the HF weight read as they lie (`concat_layout`). Fixed default configs
    (`tuned=False`): the batches' M changes every batch, and tuning per M would tune forever."""
    from quack.gemm_interface import gemm, gemm_act

    def swiglu(x, w, cu, rows):
        _, post = gemm_act(x, w.mT, activation="swiglu", cu_seqlens_m=cu, A_idx=rows, store_preact=False,
                           concat_layout=("B",), tuned=False)
        return post

    def plain(x, w, cu):
        return gemm(x, w.mT, cu_seqlens_m=cu, tuned=False)
    return swiglu, plain


def agreement(module: torch.nn.Module, forward, tokens: int = PROBE_TOKENS, seed: int = 0) -> float:
    """Relative difference of `forward` against the module's own forward on random routed tokens."""
    up = module.gate_up_proj
    assert isinstance(up, torch.Tensor), "experts_modules keeps only blocks whose gate_up_proj is a tensor"
    experts, _, hidden = up.shape
    k = max(1, min(8, int(getattr(getattr(module, "config", None), "num_experts_per_tok", 2) or 2), experts))
    g = torch.Generator(device=up.device).manual_seed(seed)
    x = torch.randn((tokens, hidden), generator=g, device=up.device).to(up.dtype)
    scores = torch.rand((tokens, experts), generator=g, device=up.device)
    weights, index = scores.topk(k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(up.dtype)
    with torch.inference_mode():
        want = type(module).forward(module, x, index, weights).float()
        got = forward(module, x, index, weights).float()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def use_grouped_experts(model: torch.nn.Module, gemms: tuple[GemmSwiglu, GemmPlain],
                        tolerance: float = PROBE_TOLERANCE, label: str = "quack") -> tuple[int, float | None]:
    """Each experts block of `model` runs `grouped_forward(*gemms)`, once it agrees with the first
    block's own forward within `tolerance` (checked once: the blocks share one class and shape).
    (modules swapped, the probe's relative difference; None when there was none to check)."""
    modules = experts_modules(model)
    if not modules:
        return 0, None
    forward = grouped_forward(*gemms)
    try:
        error = agreement(modules[0], forward)
    except Exception:
        return 0, None
    if not error <= tolerance:
        return 0, error
    for module in modules:
        module.forward = forward.__get__(module)
        # plain attributes, not parameters or submodules (nn.Module's __setattr__ is typed for those)
        setattr(module, "_fleet_compiled", True)   # reference checks set it aside (worker.reference.eager)
        setattr(module, "_fleet_fast", label)
    return len(modules), error


def use_fast_kernels(model: torch.nn.Module, device: torch.device,
                     gemms: Callable[[], tuple[GemmSwiglu, GemmPlain]] = quack_gemms,
                     label: str = "quack") -> str:
    """The fast kernels this host can run, swapped in: a note for the path line (empty when the
    model has nothing they serve), naming what runs or why today's path stays. `gemms` and
    `label`: another pair of grouped GEMMs (tests, the bench's CPU smoke)."""
    if not experts_modules(model):
        return ""
    if not wanted():
        return f"experts: transformers' grouped_mm ({FAST_ENV}=0)"
    if why := (quack_missing(device) if gemms is quack_gemms else None):
        return f"experts: transformers' grouped_mm (fast kernels: {why})"
    try:
        swapped, error = use_grouped_experts(model, gemms(), label=label)
    except Exception as e:                     # an import or a compile that fails: today's path
        return f"experts: transformers' grouped_mm (fast kernels failed: {type(e).__name__})"
    if not swapped:
        said = f"{error:.1e} from the module's own" if error is not None else "did not run"
        return f"experts: transformers' grouped_mm ({label}'s grouped GEMMs {said})"
    return (f"experts: {label}'s grouped GEMMs, SwiGLU epilogue ({swapped} blocks, {error:.1e} from their "
            f"own forward)")


def fast_note(model: torch.nn.Module) -> str:
    """What use_fast_kernels swapped in on this model, for a path line built elsewhere."""
    kinds = sorted({getattr(m, "_fleet_fast") for m in model.modules() if "_fleet_fast" in m.__dict__})
    return f"fast kernels: {', '.join(kinds)}" if kinds else ""

