"""Loading the base model and capturing exactly the requested hidden states with hooks.

Layer ids are `output_hidden_states` indices (worker.layers decides which): hs[0] is the input to
decoder layer 0 (the embedding output), hs[k] the output of decoder layer k-1, and hs[L] either the
last layer's raw output ("pre" norm, speculators' convention) or the final-normed output ("post",
what transformers itself returns as hs[L]). Only the requested tensors are kept; lm_head and logits
are never computed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .layers import LayerPlan
from .weights import ReadProgress, checkpoint_bytes, placed_bytes

HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")

# Where decoder stacks and final norms live, as attribute paths from the loaded base model.
LAYER_PATHS = ("layers", "model.layers", "language_model.layers", "model.language_model.layers",
               "decoder.layers", "transformer.h", "h")
NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")


class ModelError(Exception):
    """The model cannot be used as asked (missing path, unknown architecture, missing weights).
    `fatal`: a restart would meet it again (the weight files themselves are wrong)."""
    fatal = False


class WeightsError(ModelError):
    fatal = True


def weights_problem(info: dict, prefix: str, shown: int = 5) -> str | None:
    """What transformers' loading report says is wrong, or None. A missing or mis-shaped weight
    would be filled at random (silently: its warning is off), so the shard is refused, naming the
    tensors. An unexpected weight under the base model's own prefix is one the checkpoint has and
    this architecture does not use; one outside it (lm_head, an MTP head) belongs to a head the
    base model leaves out, and is fine."""
    def names(keys) -> str:
        keys = sorted(str(k if isinstance(k, str) else k[0]) for k in keys)
        return ", ".join(keys[:shown]) + (f" and {len(keys) - shown} more" if len(keys) > shown else "")
    missing = info.get("missing_keys") or ()
    mismatched = info.get("mismatched_keys") or ()
    unexpected = [k for k in info.get("unexpected_keys") or () if str(k).startswith(f"{prefix}.")]
    problems = []
    if missing:
        problems.append(f"{len(missing)} weight(s) missing from the checkpoint ({names(missing)})")
    if mismatched:
        problems.append(f"{len(mismatched)} weight(s) of the wrong shape ({names(mismatched)})")
    if unexpected:
        problems.append(f"{len(unexpected)} weight(s) the architecture does not have ({names(unexpected)})")
    if not problems:
        return None
    return ("; ".join(problems) + ": transformers would fill them at random; the weight files are "
            "incomplete or not this config's model")


def _get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass
class Decoder:
    layers: torch.nn.ModuleList
    norm: torch.nn.Module
    path: str


def find_decoder(model: torch.nn.Module) -> Decoder:
    for path in LAYER_PATHS:
        layers = _get_path(model, path)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            parent = _get_path(model, path.rpartition(".")[0]) if "." in path else model
            for name in NORM_NAMES:
                norm = getattr(parent, name, None)
                if isinstance(norm, torch.nn.Module):
                    return Decoder(layers, norm, path)
    raise ModelError(f"cannot find the decoder layers of {type(model).__name__}: looked for a "
                     f"ModuleList at {', '.join(LAYER_PATHS)} with a final norm named "
                     f"{', '.join(NORM_NAMES)} beside it")


def _hidden_from_args(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _hidden_from_output(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class Capture:
    """Forward hooks that keep hs[id] for the ids of a LayerPlan, and nothing else."""

    def __init__(self, decoder: Decoder, plan: LayerPlan):
        if len(decoder.layers) != plan.num_layers:
            raise ModelError(f"model has {len(decoder.layers)} decoder layers, plan says {plan.num_layers}")
        self.plan = plan
        self.slots: list[torch.Tensor | None] = [None] * len(plan.ids)
        self._handles = []
        L = plan.num_layers
        for slot, k in enumerate(plan.ids):
            if k < L:
                self._handles.append(decoder.layers[k].register_forward_pre_hook(
                    self._pre_hook(slot), with_kwargs=True))
            else:
                module = decoder.norm if plan.last_layer_norm == "post" else decoder.layers[L - 1]
                self._handles.append(module.register_forward_hook(self._out_hook(slot)))

    def _pre_hook(self, slot: int):
        def hook(module, args, kwargs):
            self.slots[slot] = _hidden_from_args(args, kwargs)
        return hook

    def _out_hook(self, slot: int):
        def hook(module, args, output):
            self.slots[slot] = _hidden_from_output(output)
        return hook

    def take(self, device: torch.device | None = None) -> torch.Tensor:
        """[B, S, n_layers, H] in bf16 on `device` (default: where the layers ran; a model spread
        over several GPUs hands in the last one); releases the references the hooks held."""
        ran = [s for s in self.slots if s is not None]
        if len(ran) != len(self.slots):
            raise RuntimeError("a hooked layer did not run")
        stacked = torch.stack([move(s.to(torch.bfloat16), device or s.device) for s in ran], dim=2)
        self.slots = [None] * len(self.slots)
        return stacked

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


# --- loading -----------------------------------------------------------------------------------

def _dtype_kwarg(dtype: torch.dtype) -> dict:
    """transformers 5 calls it `dtype`; older releases `torch_dtype`."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def compute_dtype(asked: str | None, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype the model computes in, and a note for the path line where it is not bf16 by
    default. `asked` is --model-dtype (None: choose). On a CPU without native bf16 (AVX2 only: a
    bf16 matmul runs 30x slower than fp32 there) the model computes in fp32; the files are stored
    in the dtype asked for either way (Capture.take: bf16, or fp8 from it)."""
    if asked == "fp32":
        return torch.float32, ""
    if asked == "bf16" or device.type != "cpu":
        return torch.bfloat16, ""
    bf16, fp32 = (matmul_gflops(d) for d in (torch.bfloat16, torch.float32))
    if bf16 >= 0.8 * fp32:
        return torch.bfloat16, ""
    return torch.float32, (f"computing in fp32: this CPU has no native bf16 (a matmul {bf16:.1f} GFLOP/s "
                           f"in bf16, {fp32:.1f} in fp32); stored as asked")


def matmul_gflops(dtype: torch.dtype, n: int = 256, repeats: int = 3) -> float:
    """This CPU's rate for an n x n x n matmul in `dtype` (best of `repeats`; ~0.1 s in all)."""
    a = torch.randn(n, n).to(dtype)
    torch.mm(a, a)                                    # first-call costs, untimed
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / max(best, 1e-9) / 1e9


def load_model(path: str, device: str | list[str], dtype: torch.dtype, random_weights: bool = False,
               on_read: Callable[[int, int, float], None] | None = None, interval: float = 2.0) -> torch.nn.Module:
    """The base model (AutoModel: no lm_head) on `device`, in eval mode; a list of devices spreads
    the decoder layers over them in order (see `spread`). `on_read(done, total, bytes/s)` is told
    every `interval` seconds how far the reading of the weight files has got."""
    devices = [device] if isinstance(device, str) else list(device)
    first = devices[0] if random_weights or len(devices) == 1 else "cpu"
    total = 0 if random_weights else checkpoint_bytes(path)
    with ReadProgress(total if on_read else 0, placed_bytes(first), on_read or (lambda *a: None), interval):
        model = _load(path, first, dtype, random_weights)
    if len(devices) > 1:
        spread(model, devices)
    return model


def _placed_as_read() -> bool:
    """Whether from_pretrained can put each tensor on the GPU as it reads it (device_map): always
    in transformers 5 (read by a pool of threads), with accelerate before."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5 or importlib.util.find_spec("accelerate") is not None


def _load(path: str, device: str, dtype: torch.dtype, random_weights: bool) -> torch.nn.Module:
    import transformers
    from transformers import AutoConfig, AutoModel

    transformers.utils.logging.set_verbosity_error()      # the worker's own events say what matters
    transformers.utils.logging.disable_progress_bar()
    if not os.path.isdir(path):
        raise ModelError(f"{path}: model folder not found")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelError(f"{path}: no config.json (expected a Hugging Face model folder)")
    try:
        if random_weights:
            config = AutoConfig.from_pretrained(path)
            torch.manual_seed(0)               # the same weights in every process on this device type
            with torch.device(device):
                model = AutoModel.from_config(config, **_dtype_kwarg(dtype))
        else:
            # straight to the GPU as each tensor is read, not the whole model in host memory first
            # and then copied (0.68 GB/s cold against the disk's 1.75: issue 38)
            direct = device != "cpu" and _placed_as_read()
            placement: dict[str, Any] = {"device_map": {"": device}} if direct else {}
            model, info = AutoModel.from_pretrained(path, output_loading_info=True, **_dtype_kwarg(dtype),
                                                    **placement)
            if problem := weights_problem(info, getattr(model, "base_model_prefix", "model")):
                raise WeightsError(f"{path}: {problem}")
            model.to(device)
    except (OSError, ValueError, KeyError, RuntimeError) as e:    # unreadable or truncated files
        raise ModelError(f"{path}: cannot load model: {str(e).strip().splitlines()[0][:300]}") from None
    return model.eval()


_copy_streams: dict[torch.device, Any] = {}


def move(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, asynchronously. Between two GPUs torch's copy is a two-way barrier between
    the source's and the destination's *current* streams: copying straight into the next stage
    would make the previous stage wait for everything the next one has queued, so the GPUs would
    take turns. The destination's current stream is a copy stream for the copy, and the
    destination's compute stream waits only for the copy."""
    if t.device == device:
        return t
    if t.device.type != "cuda" or device.type != "cuda":
        return t.to(device, non_blocking=True)
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams[device] = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        moved = t.to(device, non_blocking=True)
    consumer = torch.cuda.current_stream(device)
    consumer.wait_stream(stream)
    moved.record_stream(consumer)               # made on the copy stream, used on the compute one
    return moved


def _to(value: Any, device: torch.device, memo: dict) -> Any:
    """Tensors in `value` moved to `device`, each at most once per forward (the rotary tables
    would otherwise cross again for every layer); `memo` holds what this forward already moved."""
    if isinstance(value, torch.Tensor):
        if value.device == device:
            return value
        key = (id(value), device)
        if key not in memo:
            memo[key] = (value, move(value, device))     # keep the source alive
        return memo[key][1]
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device, memo) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device, memo) for k, v in value.items()}
    return value


def spread(model: torch.nn.Module, devices: list[str]) -> None:
    """Split the decoder layers over `devices` in order (contiguous, balanced by count), the final
    norm on the last, everything else (embeddings, rotary tables) on the first. A pre-hook moves
    each layer's tensor inputs to its device (`move`: asynchronous, and no stage waits for the
    next one's queue), so the next micro-batch's first stage runs while this one's last stage
    does, and every GPU stays busy."""
    decoder = find_decoder(model)
    targets = [torch.device(d) for d in devices]
    n, k = len(decoder.layers), len(targets)

    memo: dict = {}

    def mover(device, first: bool = False):
        def hook(module, args, kwargs):
            if first:
                memo.clear()                       # a new forward: last one's tensors are stale
            return _to(args, device, memo), _to(kwargs, device, memo)
        return hook
    decoder.layers[0].register_forward_pre_hook(mover(targets[0], first=True), with_kwargs=True)
    for i, layer in enumerate(decoder.layers):
        layer.to(targets[i * k // n])
        layer.register_forward_pre_hook(mover(targets[i * k // n]), with_kwargs=True)
    decoder.norm.to(targets[-1])
    decoder.norm.register_forward_pre_hook(mover(targets[-1]), with_kwargs=True)
    placed = {id(p) for m in (*decoder.layers, decoder.norm) for p in (*m.parameters(), *m.buffers())}
    for module in model.modules():                 # the rest: to the first device
        for name, p in list(module._parameters.items()):
            if p is not None and id(p) not in placed:
                p.data = p.data.to(targets[0])
        for name, b in list(module._buffers.items()):
            if b is not None and id(b) not in placed:
                module._buffers[name] = b.to(targets[0])
    setattr(model, "devices", targets)             # a plain attribute: nn.Module's __setattr__ is typed for modules


def compile_layers(model: torch.nn.Module) -> None:
    """torch.compile each decoder layer's forward, with dynamic shapes so batch widths and row
    counts reuse the graphs. The hooks stay outside (they run in the module's __call__, not in
    forward). Each layer gets its own graph (its index is a constant in it), so the recompile
    limit is raised to fit them; identical graphs hit Inductor's cache after the first."""
    decoder = find_decoder(model)
    _compile_forwards(decoder.layers, 4 * len(decoder.layers) + 16)


def _compile_forwards(modules, limit: int) -> int:
    """Each module's forward compiled (dynamic shapes), one torch.compile per class: identical
    graphs of other instances hit Inductor's cache. The recompile limit is raised to `limit`."""
    import functools

    import torch._dynamo
    for name in ("recompile_limit", "cache_size_limit"):        # the name depends on torch's version
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
    compiled = {}
    for module in modules:
        cls = type(module)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, dynamic=True)
        module.forward = functools.partial(compiled[cls], module)
        module._fleet_compiled = True
    return len(modules)


@contextlib.contextmanager
def unpacked_rows():
    """The worker's forwards, without transformers' search for packed sequences. With no
    attention mask and no cache, transformers (from 4.53, `masking_utils`) looks in every
    forward for several sequences packed into one row (`find_packed_sequence_indices`), and
    reads the answer on the host: a GPU-to-host sync at the start of every batch, which drains
    the GPU's queue, so the host has to launch the whole forward anew while the GPU waits (15%
    of the dense bench pass idle, docs/benchmarks.md round 7). The worker never packs: each row
    is one sample, its padding after it, its positions those the model numbers itself (0, 1,
    2, ...), for which that search answers "none" (None). Inside this block it answers so
    without looking; a transformers without it is left alone."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    find = getattr(masking_utils, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return
    masking_utils.find_packed_sequence_indices = _none
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = find


def _none(*args, **kwargs):
    return None


# The parts of a hybrid decoder layer that hold no fla kernel, by class-name ending.
REGION_KINDS = ("RMSNorm", "RMSNormGated", "MLP", "Attention")


def compile_regions(model: torch.nn.Module) -> int:
    """Hybrid models: compiling whole layers with fla's Triton kernels inside did not finish in
    minutes, while eager, their norms, gated norms, MLP activations and attention gates cost a
    third of the GPU's time as chains of unfused fp32 elementwise kernels. So each layer's
    outermost modules that hold no fla kernel are compiled (regional compile) and the
    linear-attention blocks stay eager: 18% less GPU time per forward on the 7.8B bench shape,
    with no added drift (docs/benchmarks.md). Returns how many modules took."""
    def outermost(module: torch.nn.Module) -> list[torch.nn.Module]:
        name = type(module).__name__
        if name.endswith(REGION_KINDS) and not name.endswith("LinearAttention"):      # fla's inside
            return [] if "forward" in module.__dict__ else [module]      # swapped already: kept
        return [m for child in module.children() for m in outermost(child)]
    decoder = find_decoder(model)
    regions = [m for module in (*decoder.layers, decoder.norm) for m in outermost(module)]
    return _compile_forwards(regions, 2 * len(regions) + 16)


def uncompile_layers(model: torch.nn.Module) -> None:
    """Back to eager: the layers or regions that compile_layers / compile_regions compiled."""
    for module in model.modules():
        if module.__dict__.pop("_fleet_compiled", False):
            module.__dict__.pop("forward", None)


def is_hybrid(model: torch.nn.Module) -> bool:
    return getattr(text_config(model), "model_type", "") in HYBRID_MODEL_TYPES


def model_devices(model: torch.nn.Module, default: torch.device) -> list[torch.device]:
    """The devices a model runs on, in order: the first takes the input ids, the last the output."""
    return list(getattr(model, "devices", None) or [default])


def text_config(model: torch.nn.Module) -> Any:
    config = model.config
    return getattr(config, "text_config", None) or config


def fla_causal_conv1d():
    """flash-linear-attention's Triton causal convolution in causal-conv1d's calling convention
    (x [B, D, T] -> [B, D, T]), or None without fla. The causal-conv1d package builds from CUDA
    source at install; fla ships the same operation as a Triton kernel."""
    from .gdn import fla_conv
    timewise = fla_conv()                        # [B, T, D] -> [B, T, D]
    if timewise is None:
        return None

    def conv(x=None, weight=None, bias=None, activation=None, hidden_states=None, seq_idx=None, **_):
        x = hidden_states if x is None else x
        return timewise(x.transpose(1, 2), weight, bias, activation).transpose(1, 2)
    return conv


def use_fla_conv(model: torch.nn.Module) -> bool:
    """A hybrid model without causal-conv1d on a GPU: its linear-attention layers' short
    convolution runs fla's Triton kernel instead of transformers' reference conv. transformers
    reads it from the layer (`self.causal_conv1d_fn`, up to 4.x) or from its module's
    `causal_conv1d_fn` (5.x); both are set. True when it took."""
    if not is_hybrid(model):
        return False
    from .gdn import linear_attention_layers
    return use_fla_conv_on(linear_attention_layers(model))


def use_fla_conv_on(layers: list[torch.nn.Module]) -> bool:
    """use_fla_conv for these linear-attention layers (a model's, or a block built alone)."""
    import inspect
    if importlib.util.find_spec("causal_conv1d") is not None:
        return False
    conv = fla_causal_conv1d()
    if conv is None or not layers:
        return False
    took = False
    for layer in layers:
        if hasattr(layer, "causal_conv1d_fn"):
            layer.causal_conv1d_fn, took = conv, True
    module = inspect.getmodule(type(layers[0]))
    if module is not None and hasattr(module, "causal_conv1d_fn"):
        setattr(module, "causal_conv1d_fn", conv)
        took = True
    return took


def fla_norm_kernels():
    """flash-linear-attention's fused RMS norm kernels (plain, gated), or None without fla on a GPU.
    fla 0.6 keeps them under fla.modules.norm, earlier releases under fla.modules."""
    if not torch.cuda.is_available():
        return None
    for base in ("fla.modules.norm", "fla.modules"):
        try:
            plain = importlib.import_module(f"{base}.layernorm").rms_norm
            gated = importlib.import_module(f"{base}.fused_norm_gate").rms_norm_gated
            return plain, gated
        except Exception:
            continue
    return None


NORM_WIDTH_MIN = 513   # below this fla's plain norm tunes per token count (per batch shape): kept as is


def use_fla_norms(model: torch.nn.Module, kernels=None, min_width: int = NORM_WIDTH_MIN) -> int:
    """Hybrid models run eager, and their RMS norms cost a sixth of the GPU's time as chains of
    fp32 elementwise kernels (profiled in docs/benchmarks.md). Each kind of RMS norm (the decoder's,
    `…RMSNorm`; the linear-attention layers' `…RMSNormGated`) runs fla's fused kernel instead, once
    checked against its own forward on a probe input, with the weight convention (`w` or `1 + w`,
    which Qwen3.5 uses) found by that check; a kind that matches neither keeps its own forward.
    `kernels` = (rms_norm, rms_norm_gated) in fla's calling convention (tests pass their own).
    Returns how many modules took. Not yet on in the worker: on a cold Triton cache the first
    forwards with these kernels stalled for minutes on the H200 (docs/benchmarks.md)."""
    kernels = kernels or fla_norm_kernels()
    if kernels is None:
        return 0
    plain, gated = kernels
    chosen: dict[type, int | None] = {}      # kind -> weight offset (0 or 1), None: keep its own
    took = 0
    for module in list(model.modules()):
        kind = type(module)
        name = kind.__name__
        is_gated = name.endswith("RMSNormGated")
        weight = getattr(module, "weight", None)
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if not (is_gated or name.endswith("RMSNorm")) or not isinstance(weight, torch.Tensor) \
                or weight.dim() != 1 or not isinstance(eps, float) or "forward" in module.__dict__:
            continue
        if not is_gated and weight.numel() < min_width:
            continue
        if kind not in chosen:
            chosen[kind] = _norm_offset(module, plain, gated, is_gated, float(eps))
        offset = chosen[kind]
        if offset is None:
            continue
        module.forward = _fused_norm(module, plain, gated, is_gated, float(eps), offset)
        took += 1
    return took


def _fused_norm(module, plain, gated, is_gated: bool, eps: float, offset: int):
    weight = (module.weight.detach().float() + offset).contiguous()
    activation = getattr(module, "activation", "silu")
    if is_gated:
        return lambda x, gate, *_, **__: gated(x, gate, weight, None, activation=activation, eps=eps)
    return lambda x, *_, **__: plain(x, weight, None, eps=eps)


def _norm_offset(module, plain, gated, is_gated: bool, eps: float) -> int | None:
    """Which weight convention makes fla's kernel agree with this norm's own forward, if any."""
    weight = module.weight
    g = torch.Generator(device=weight.device).manual_seed(0)
    shape = (64, weight.numel())
    dtype = weight.dtype if weight.dtype in (torch.bfloat16, torch.float16) else torch.float32
    x = torch.randn(shape, generator=g, device=weight.device).mul_(3).to(dtype)
    gate = torch.randn(shape, generator=g, device=weight.device).to(dtype)
    try:
        with torch.inference_mode():
            want = (module(x, gate) if is_gated else module(x)).float()
            for offset in (0, 1):
                got = _fused_norm(module, plain, gated, is_gated, eps, offset)(x, gate)
                if float((got.float() - want).norm() / want.norm().clamp_min(1e-12)) < 1e-2:
                    return offset
    except Exception:
        return None
    return None


def missing_fast_kernels(model: torch.nn.Module) -> str | None:
    """For hybrid Gated DeltaNet models, which fast-kernel packages are absent (None: all there)."""
    if not is_hybrid(model):
        return None
    missing = [pkg for pkg, mod in (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))
               if importlib.util.find_spec(mod) is None
               and not (mod == "causal_conv1d" and fla_causal_conv1d() is not None)]   # fla's stands in
    if not missing:
        return None
    return (f"fast Gated DeltaNet kernels missing ({', '.join(missing)}): transformers falls back "
            f"to slow reference kernels")


# --- the FLOP model: the parameters a token meets (issue 56) ----------------------------------

def moe_shape(config: Any) -> tuple[int, int] | None:
    """(experts, experts a token is routed to) of a mixture-of-experts config, else None."""
    config = getattr(config, "text_config", None) or config
    experts = next((getattr(config, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(getattr(config, n, None), int)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not isinstance(top_k, int) or top_k <= 0 or experts <= 1:
        return None
    return experts, top_k


def active_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(non-embedding parameters, those a token meets): a mixture of experts' expert weights
    count top-k / experts of themselves (each token runs k of the E experts), its router and
    shared experts whole. Counted from the modules, so any layout counts as it is built: the
    fused one (3-D `gate_up_proj` / `down_proj` of E experts) or a ModuleList `experts`. What
    MFU counts for an MoE (2 x active x tokens/s over the peak) and what the ETA's FLOP model
    weighs a token by. Input embeddings are left out (a lookup); an LM head is not built here."""
    config = text_config(model) if hasattr(model, "config") else None
    moe = moe_shape(config) if config is not None else None
    # transformers' PreTrainedModel method, where the model has one (nn.Module types attributes as tensors/modules)
    embeddings: torch.nn.Module | None = (getattr(model, "get_input_embeddings")()
                                          if hasattr(model, "get_input_embeddings") else None)
    skip = {id(p) for p in embeddings.parameters()} if embeddings is not None else set()
    total = sum(p.numel() for p in model.parameters() if id(p) not in skip)
    if moe is None:
        return total, total
    experts, top_k = moe
    inactive = 0
    for module in model.modules():
        if type(module).__name__.endswith("Experts") or isinstance(getattr(module, "gate_up_proj", None), torch.Tensor):
            params = [p for p in module.parameters(recurse=False) if p.dim() == 3 and p.shape[0] == experts]
            inactive += sum(p.numel() for p in params) * (experts - top_k) // experts
        elif isinstance(listed := getattr(module, "experts", None), torch.nn.ModuleList) and len(listed) == experts:
            inactive += sum(p.numel() for p in listed.parameters()) * (experts - top_k) // experts
    return total, total - inactive


def config_active_parameters(config: Any) -> tuple[int, int]:
    """active_parameters of the model `config` describes, built on the meta device (no memory)."""
    from transformers import AutoModel
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    return active_parameters(model)


# Tokens a batch gives each expert: a grouped GEMM of m rows x K=hidden is far from its peak when
# m is a few hundred. The budget an MoE's batches get so each expert gets about this many rows on
# average (docs/benchmarks.md, issue 56: the experts' GEMMs at N tokens a batch on an H100).
EXPERT_ROWS = 2048


def expert_rows(tokens: int, config: Any) -> float | None:
    """Rows each expert's GEMM gets on average from a batch of `tokens` (None: not an MoE)."""
    moe = moe_shape(config)
    return tokens * moe[1] / moe[0] if moe else None


def experts_budget(budget: int, config: Any, rows: int = EXPERT_ROWS, cap: int = 65536) -> int:
    """The token budget of an MoE's batches: at least `rows` rows per expert on average (128
    experts, 8 a token: 32,768 tokens for 2,048), at most `cap`; a dense model's is `budget`."""
    moe = moe_shape(config)
    if moe is None:
        return budget
    experts, top_k = moe
    return max(budget, min(cap, -(-rows * experts // top_k)))
