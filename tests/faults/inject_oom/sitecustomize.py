"""Fault injection for the OOM test: in a process started with FLEET_INJECT_OOM_ABOVE=N on its
PYTHONPATH, every embedding lookup over N tokens raises CUDA's out-of-memory error, as a GPU with
too little memory would. The model itself is real and untouched."""

import os

if os.environ.get("FLEET_INJECT_OOM_ABOVE"):
    import torch
    import torch.nn.functional as F

    _limit = int(os.environ["FLEET_INJECT_OOM_ABOVE"])
    _embedding = F.embedding

    def embedding(input, weight, *args, **kwargs):
        if input.numel() > _limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected above {_limit} tokens)")
        return _embedding(input, weight, *args, **kwargs)

    F.embedding = embedding
