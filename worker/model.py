"""Loading the base model and capturing exactly the requested hidden states with hooks.

Layer ids are `output_hidden_states` indices (worker.layers decides which): hs[0] is the input to
decoder layer 0 (the embedding output), hs[k] the output of decoder layer k-1, and hs[L] either the
last layer's raw output ("pre" norm, speculators' convention) or the final-normed output ("post",
what transformers itself returns as hs[L]). Only the requested tensors are kept; lm_head and logits
are never computed.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from .layers import LayerPlan

HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")

# Where decoder stacks and final norms live, as attribute paths from the loaded base model.
LAYER_PATHS = ("layers", "model.layers", "language_model.layers", "model.language_model.layers",
               "decoder.layers", "transformer.h", "h")
NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm")


class ModelError(Exception):
    """The model cannot be used as asked (missing path, unknown architecture)."""


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

    def take(self) -> torch.Tensor:
        """[B, S, n_layers, H] in bf16; releases the references the hooks held."""
        if any(s is None for s in self.slots):
            raise RuntimeError("a hooked layer did not run")
        stacked = torch.stack([s.to(torch.bfloat16) for s in self.slots], dim=2)
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


def load_model(path: str, device: str, dtype: torch.dtype, random_weights: bool = False) -> torch.nn.Module:
    """The base model (AutoModel: no lm_head) on `device`, in eval mode."""
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
            with torch.device(device):
                model = AutoModel.from_config(config, **_dtype_kwarg(dtype))
        else:
            model = AutoModel.from_pretrained(path, **_dtype_kwarg(dtype))
            model.to(device)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"{path}: cannot load model: {str(e).splitlines()[0]}") from None
    return model.eval()


def text_config(model: torch.nn.Module) -> Any:
    config = model.config
    return getattr(config, "text_config", None) or config


def missing_fast_kernels(model: torch.nn.Module) -> str | None:
    """For hybrid Gated DeltaNet models, which fast-kernel packages are absent (None: all there)."""
    if getattr(text_config(model), "model_type", "") not in HYBRID_MODEL_TYPES:
        return None
    missing = [pkg for pkg, mod in (("flash-linear-attention", "fla"), ("causal-conv1d", "causal_conv1d"))
               if importlib.util.find_spec(mod) is None]
    if not missing:
        return None
    return (f"fast Gated DeltaNet kernels missing ({', '.join(missing)}): transformers falls back "
            f"to slow reference kernels")
