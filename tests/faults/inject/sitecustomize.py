"""Fault injection for the worker's fault tests, in a process started with this folder on its
PYTHONPATH. The model itself is real and untouched; the embedding lookup fails as a GPU would:

- FLEET_INJECT_OOM_ABOVE=N: every lookup over N tokens raises CUDA's out-of-memory error;
- FLEET_INJECT_ERROR_TOKEN=T: every lookup holding token id T raises a RuntimeError (a sample
  that trips a kernel bug, a bad shape, anything a single sample can cause).
"""

import os

if os.environ.get("FLEET_INJECT_OOM_ABOVE") or os.environ.get("FLEET_INJECT_ERROR_TOKEN"):
    import torch
    import torch.nn.functional as F

    _limit = int(os.environ.get("FLEET_INJECT_OOM_ABOVE") or 0)
    _token = int(os.environ.get("FLEET_INJECT_ERROR_TOKEN") or -1)
    _embedding = F.embedding

    def embedding(input, weight, *args, **kwargs):
        if _limit and input.numel() > _limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected above {_limit} tokens)")
        if _token >= 0 and bool((input == _token).any()):
            raise RuntimeError(f"injected failure on token {_token}\nsecond line")
        return _embedding(input, weight, *args, **kwargs)

    F.embedding = embedding
