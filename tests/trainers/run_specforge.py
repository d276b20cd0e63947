"""`python -m tests.trainers.run_specforge <specforge train args>`: SpecForge's own `train`
(specforge.cli.main: its config, offline feature reader, normaliser, collator, model, FSDP wrapper
and optimiser) on the CPU; prints one JSON line: every feature file its data plane loaded with
that file's supervised-token count, and the loss of every backward pass.

Patched, all GPU-only: Triton (not installed on a CPU host) is stubbed so SpecForge's loss module
imports, and its Triton kernel `LogSoftmaxLoss` is swapped for the reference formula in the same
file (`_compute_loss`, imported uncompiled). The test's run.yaml sets `training.fsdp_sharding: NO_SHARD` and
`training.attention_backend: sdpa` (SpecForge's own settings).
"""

from __future__ import annotations

import json
import sys
import types
from unittest import mock

import torch


def _import_loss_without_triton():
    """specforge.core.loss with a stand-in `triton` present only while it imports (torch itself
    must keep seeing no Triton)."""
    triton = types.ModuleType("triton")
    triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
    triton.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    language = types.ModuleType("triton.language")
    language.constexpr = int
    triton.language = language
    eager = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)          # noqa: E731
    with mock.patch.dict(sys.modules, {"triton": triton, "triton.language": language}), \
            mock.patch("torch.compile", eager):      # its reference formula, uncompiled
        from specforge.core import loss
    sys.modules["specforge.core.loss"] = loss                    # kept; the stand-in is gone
    return loss


def main(argv: list[str]) -> int:
    import specforge.core  # noqa: F401
    loss = _import_loss_without_triton()
    import specforge.algorithms.eagle3.model  # noqa: F401
    from specforge import cli
    from specforge.runtime.data_plane import feature_store

    reference = loss._compute_loss
    loaded: dict[str, int] = {}
    losses: list[float] = []
    load, backward = feature_store.load_feature_file, torch.Tensor.backward

    def spy_load(path, *a, **k):
        raw = load(path, *a, **k)
        loaded[str(path)] = int(raw["loss_mask"].sum())
        return raw

    def spy_backward(t, *a, **k):
        losses.append(float(t.detach()))
        return backward(t, *a, **k)

    reference_loss = types.SimpleNamespace(apply=lambda logits, target, mask: reference(logits, target, mask))
    with mock.patch.object(loss, "LogSoftmaxLoss", reference_loss), \
            mock.patch("specforge.algorithms.eagle3.model.LogSoftmaxLoss", reference_loss), \
            mock.patch.object(feature_store, "load_feature_file", spy_load), \
            mock.patch.object(torch.Tensor, "backward", spy_backward):
        rc = cli.main(argv)
    print(json.dumps({"rc": rc, "loaded": loaded, "losses": losses}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
