"""Fault injection for the worker's fault tests, in a process started with this folder on its
PYTHONPATH. The model itself is real and untouched; the embedding lookup fails as a GPU would:

- FLEET_INJECT_OOM_ABOVE=N: every lookup over N tokens raises CUDA's out-of-memory error;
- FLEET_INJECT_OOM_TIMES=N: the first N lookups of the process raise it (memory that was short
  for a moment);
- FLEET_INJECT_ERROR_TOKEN=T: every lookup holding token id T raises a RuntimeError (a sample
  that trips a kernel bug, a bad shape, anything a single sample can cause);
- FLEET_INJECT_ABORT_TOKEN=T: a lookup holding token id T kills the process with SIGABRT, as a
  CUDA device-side assert does (nothing to catch);
- FLEET_INJECT_CUDA_ASSERT_TOKEN=T: a lookup holding token id T indexes out of bounds on the
  device: a real device-side assert on a GPU (reported asynchronously, later).
"""

import os

_VARS = ("FLEET_INJECT_OOM_ABOVE", "FLEET_INJECT_OOM_TIMES", "FLEET_INJECT_ERROR_TOKEN",
         "FLEET_INJECT_ABORT_TOKEN", "FLEET_INJECT_CUDA_ASSERT_TOKEN")

if any(os.environ.get(v) for v in _VARS):
    import torch
    import torch.nn.functional as F

    _limit = int(os.environ.get("FLEET_INJECT_OOM_ABOVE") or 0)
    _times = [int(os.environ.get("FLEET_INJECT_OOM_TIMES") or 0)]
    _token = int(os.environ.get("FLEET_INJECT_ERROR_TOKEN") or -1)
    _abort = int(os.environ.get("FLEET_INJECT_ABORT_TOKEN") or -1)
    _assert = int(os.environ.get("FLEET_INJECT_CUDA_ASSERT_TOKEN") or -1)
    _embedding = F.embedding

    def embedding(input, weight, *args, **kwargs):
        if _limit and input.numel() > _limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected above {_limit} tokens)")
        if _times[0] > 0:
            _times[0] -= 1
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected, passing)")
        if _token >= 0 and bool((input == _token).any()):
            raise RuntimeError(f"injected failure on token {_token}\nsecond line")
        if _abort >= 0 and bool((input == _abort).any()):
            os.abort()
        out = _embedding(input, weight, *args, **kwargs)
        if _assert >= 0:                 # no sync here: the index is checked on the device
            hit = (input == _assert).any().long() * (weight.shape[0] + 5)
            out = out + weight[hit.reshape(1)].sum() * 0
        return out

    F.embedding = embedding
